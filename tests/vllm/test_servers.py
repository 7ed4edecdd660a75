"""Two vLLM servers sharing KV through Ceph's S3 gateway (RGW, tests/ceph.py) + redis-server,
production servers both, and what happens to them when objects are corrupted or deleted and
when Redis dies; a real Prometheus scrapes both the whole time, and the fleet dashboard's
and the alert rules' queries are evaluated on what it saw. A server told to require its
backends refuses to start against a missing bucket."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from botocore.config import Config

from kvcloud import KVCloud
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from scripts.fleet.vllm_fleet import VLLMServer, cached_tokens, kvcloud_transfer_config
from tests.ceph import CephRGW
from tests.prometheus import Prometheus, finite_values
from tests.servers import RedisServer, s3_env, start_redis
from tests.vllm.conftest import prompt_tokens, serving
from tests.vllm.helpers import assert_same_answer, connector_namespace, wait_stored

# vLLM servers take ~40 s each to start, more when several start together on 2 cores
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256
SECRET = "vllm-servers-secret"
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "kvcloud-vllm-fleet.json"
RULES = ROOT / "infra" / "prometheus" / "rules" / "kvcloud.rules.yml"


@pytest.fixture(scope="module")
def backends(
    tmp_path_factory: pytest.TempPathFactory, ceph_rgw: CephRGW
) -> Iterator[tuple[CephRGW, RedisServer]]:
    # the session's Ceph; a Redis of the module's own: this module kills it
    redis = start_redis(tmp_path_factory.mktemp("vllm-redis"))
    yield ceph_rgw, redis
    redis.stop()


@pytest.fixture(scope="module")
def env(backends: tuple[CephRGW, RedisServer]) -> dict[str, str]:
    ceph, redis = backends
    return {
        **s3_env(ceph.endpoint),
        "KVCLOUD_STORE": ceph.store_url("kvcloud", "vllm"),
        "KVCLOUD_INDEX": redis.url,
        "KVCLOUD_SECRET": SECRET,
        # a dead Redis must cost a request at most this, not a long hang
        "KVCLOUD_CONNECT_TIMEOUT": "0.5",
        "KVCLOUD_READ_TIMEOUT": "1",
        # as the Kubernetes manifests run it: the backends probed at start
        "KVCLOUD_REQUIRE": "1",
    }


@pytest.fixture(scope="module")
def servers(
    env: dict[str, str], vllm_logs: Path, reference: VLLMServer
) -> Iterator[dict[str, VLLMServer]]:
    cfg = kvcloud_transfer_config()
    s1 = VLLMServer("S1", vllm_logs / "S1.log", transfer=cfg, env=env)
    s2 = VLLMServer("S2", vllm_logs / "S2.log", transfer=cfg, env=env)
    yield from serving(s1, s2)


@pytest.fixture(scope="module", autouse=True)
def prometheus(
    servers: dict[str, VLLMServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Scrapes both servers every second from the module's first test to its last, with
    kvcloud's rules loaded (infra/prometheus/rules)."""
    targets = [s.url.removeprefix("http://") for s in servers.values()]
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), {"vllm": targets}, [RULES]).start()
    prom.started = time.time()  # type: ignore[attr-defined]
    yield prom
    prom.stop()


def test_restore_through_s3_and_redis(
    servers: dict[str, VLLMServer], reference: VLLMServer, env: dict[str, str]
) -> None:
    s1, s2 = servers["S1"], servers["S2"]
    prompt = prompt_tokens(2000, seed=11)
    s1.complete(prompt, max_tokens=4)
    assert wait_stored(env, prompt) == 7
    turn = [*prompt, *prompt_tokens(100, seed=12)]
    got = s2.complete(turn, max_tokens=16)
    assert cached_tokens(got) >= len(prompt) // CHUNK * CHUNK
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "S2, restored via S3")


def _object_keys(env: dict[str, str], server: VLLMServer, prompt: list[int]) -> list[str]:
    """The object keys of a prompt's chunks, found by a plain kvcloud client that derives the
    connector's namespace on its own (and checks it against the one the server logged)."""
    logged = re.findall(r"namespace ([0-9a-f]{32})", server.log_text())[-1]
    ns = connector_namespace()
    assert ns.id == logged
    assert wait_stored(env, prompt) == len(prompt) // CHUNK
    with KVCloud.open(store=env["KVCLOUD_STORE"], index=env["KVCLOUD_INDEX"], secret=SECRET) as k:
        fps = k.fingerprints(ns, prompt, VLLMConnectorConfig().tenant)
        entries = k.index.lookup(ns.id, [fp.hex() for fp in fps])
    return [e.object_key for e in entries if e is not None]


def test_corrupt_and_deleted_objects_and_dead_redis_are_recomputed(
    servers: dict[str, VLLMServer],
    reference: VLLMServer,
    env: dict[str, str],
    backends: tuple[CephRGW, RedisServer],
) -> None:
    s1, s2 = servers["S1"], servers["S2"]
    prompt = prompt_tokens(1800, seed=13)  # 7 full chunks
    s1.complete(prompt, max_tokens=2)
    keys = _object_keys(env, s1, prompt)
    assert len(keys) == 7
    ceph, redis = backends
    s3 = boto3.client(
        "s3",
        endpoint_url=ceph.endpoint,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    bucket = "kvcloud"
    keys = [f"vllm/{k}" for k in keys]  # the store URL's prefix
    # chunk 2: same size, one byte flipped (digest check); chunk 4: gone
    body = bytearray(s3.get_object(Bucket=bucket, Key=keys[2])["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=keys[2], Body=bytes(body))
    s3.delete_object(Bucket=bucket, Key=keys[4])
    before = s2.metrics()

    turn = [*prompt, *prompt_tokens(50, seed=14)]
    got = s2.complete(turn, max_tokens=16)
    # the index still named all 7 chunks, so vLLM was offered (and reports as cached) all
    # of them; chunks 0 and 1 load, chunk 2 fails verification, chunk 4 is missing, and
    # chunks 2..6 go back to vLLM as failed blocks and are recomputed
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "S2, corrupt + deleted")
    after = s2.metrics()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["verify_failures"] == 1
    assert delta["missing_objects"] == 1
    assert delta["loaded_tokens"] == 2 * CHUNK
    assert delta["load_failed_blocks"] == 5 * CHUNK // 128
    # the bad entries were dropped: the next request is offered only the good run
    again = s2.complete([*prompt, 9, 9, 9], max_tokens=4)
    assert cached_tokens(again) >= 2 * CHUNK
    assert_same_answer(
        again, reference.complete([*prompt, 9, 9, 9], max_tokens=4), "S2, after the drop"
    )
    # the flipped object's bytes did not match its key: deleted after its entry. S2 saved
    # chunks 2..6 again as it recomputed them, so the store is whole once more: a plain
    # client reads all 7 (before, a re-push of chunk 2's bytes found the damaged object
    # "already there" and named it again)
    assert delta.get("damaged_deleted", 0) == 1
    assert wait_stored(env, prompt) == 7
    with KVCloud.open(store=env["KVCLOUD_STORE"], index=env["KVCLOUD_INDEX"], secret=SECRET) as k:
        pulled = k.pull_detailed(k.lookup(connector_namespace(), prompt))
    assert pulled.chunks == 7 and not pulled.failures, pulled.failures
    try:  # the same key again where the recompute was bit for bit, else another key
        rewritten: bytes | None = s3.get_object(Bucket=bucket, Key=keys[2])["Body"].read()
    except s3.exceptions.NoSuchKey:
        rewritten = None
    assert rewritten != bytes(body)

    # Redis dies: lookups and pushes fail, answers stay right
    redis.kill()
    try:
        prompt2 = prompt_tokens(1200, seed=15)
        for server in (s1, s2):
            got = server.complete(prompt2, max_tokens=8)
            assert cached_tokens(got) == 0
            assert_same_answer(
                got, reference.complete(prompt2, max_tokens=8), f"{server.name}, Redis dead"
            )
        m = s2.metrics()
        assert m["lookup_errors"] >= 1
    finally:
        redis.start()
    # and once Redis is back, the next prompts are stored and shared again
    prompt3 = prompt_tokens(800, seed=16)
    s1.complete(prompt3, max_tokens=2)
    assert wait_stored(env, prompt3) == 3
    got = s2.complete([*prompt3, 1, 2, 3], max_tokens=8)
    assert cached_tokens(got) >= 3 * CHUNK


def test_the_start_line_says_what_this_server_shares(servers: dict[str, VLLMServer]) -> None:
    # the key id, computed here from its definition, not by kvcloud's code: HMAC-SHA256 of
    # the tenant key (itself HMAC-SHA256 of the secret), 12 hex digits
    tenant_key = hmac.new(SECRET.encode(), b"kvcloud-tenant-v1\x00default", hashlib.sha256)
    kid = hmac.new(tenant_key.digest(), b"kvcloud-key-id-v1", hashlib.sha256).hexdigest()[:12]
    for server in servers.values():
        (line,) = [ln for ln in server.log_text().splitlines() if "connector (scheduler):" in ln]
        assert re.search(r"kvcloud \d+\.\d+\.\d+\S* connector", line), line
        assert f"key id {kid} (tenant default)" in line, line
        assert "store s3://kvcloud/vllm" in line and "index redis://" in line, line
        assert "loads auto" in line and "backends probed (KVCLOUD_REQUIRE)" in line, line
        assert SECRET not in server.log_text()
        # and the same on /metrics, for a dashboard to compare servers
        info = [
            ln
            for ln in httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
            if ln.startswith("vllm:kvcloud_info{")
        ]
        assert info and all(f'key_id="{kid}"' in ln and 'load_mode="auto"' in ln for ln in info)


def test_a_required_server_refuses_a_missing_bucket(
    env: dict[str, str], vllm_logs: Path, backends: tuple[CephRGW, RedisServer]
) -> None:
    ceph, _redis = backends
    # (without the tests' create_bucket=true, as in production)
    url = ceph.store_url("no-such-bucket", "vllm").replace("&create_bucket=true", "")
    bad = {**env, "KVCLOUD_STORE": url}
    server = VLLMServer(
        "refused", vllm_logs / "refused.log", transfer=kvcloud_transfer_config(), env=bad,
        in_process=True,
    ).start()  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.wait_ready(timeout=300)
    finally:
        server.stop()
    lines = [ln for ln in server.log_text().splitlines() if "kvcloud connector cannot start" in ln]
    assert lines, server.log_tail()
    assert "no-such-bucket" in lines[0] and "bucket" in lines[0].split("cannot start:")[1]


# panels whose figures the module's work must move above zero at some time: restores (hit
# rate, times, sizes, bytes), saves, lookups, and the faults it makes (a corrupt object, a
# dead Redis)
MUST_RISE = (
    "Hit rate: prompt tokens from kvcloud, per model",
    "Hit rate per server",
    "Restore time",
    "Lookup time",
    "Bytes in and out",
    "Restores and saves",
    "Drops and failures",
    "Circuit breakers",
    "Save lag and upload time",
    "Restore size and copy-out time",
)


def test_the_fleet_dashboard_and_alerts_see_the_servers(
    servers: dict[str, VLLMServer],
    prometheus: Prometheus,
    backends: tuple[CephRGW, RedisServer],
) -> None:
    s2 = servers["S2"]
    # open S2's index breaker: Redis dies, and three lookups in a row fail
    _ceph, redis = backends
    redis.kill()
    try:
        for seed in range(40, 44):
            s2.complete(prompt_tokens(300, seed=seed), max_tokens=1)
        assert s2._scrape()["vllm:kvcloud_index_breaker_open"] == 1
        time.sleep(3)  # scraped
    finally:
        redis.start()
    end = time.time()
    start = prometheus.started  # type: ignore[attr-defined]

    failures: list[str] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        values: list[float] = []
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            expr = expr.replace("$model", ".*").replace("$instance", ".*")
            result = prometheus.query_range(expr, start, end)
            if not result:  # every query names series that exist
                failures.append(f"{panel['title']}: {expr} returned no series")
            values += finite_values(result)
        if not values:
            failures.append(f"{panel['title']}: no data")
        elif panel["title"] in MUST_RISE and max(values) <= 0:
            failures.append(f"{panel['title']}: never rose above 0")
    assert not failures, "\n".join(failures)

    # the table: both servers, one key id, the same store and index
    (table,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "table"]
    rows = prometheus.query(table["targets"][0]["expr"].replace("$model", ".*").replace(
        "$instance", ".*"))  # fmt: skip
    assert len(rows) == 2
    assert (
        len({(r["metric"]["key_id"], r["metric"]["store"], r["metric"]["index"]) for r in rows})
        == 1
    )

    # every rule loads and evaluates without error; the recording rules have data, the hit
    # rate above 0; the faults made here raised their alerts (pending where a `for` holds)
    rules = prometheus.rules()
    assert rules and all(r["health"] == "ok" and not r.get("lastError") for r in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
    ]
    hit = finite_values(prometheus.query_range("kvcloud:hit_ratio:rate5m", start, end))
    assert hit and max(hit) > 0
    for record in ("kvcloud:hit_ratio:rate1h", "kvcloud:restore_seconds:p99_5m",
                   "kvcloud:lookup_seconds:p99_5m"):  # fmt: skip
        assert finite_values(prometheus.query_range(record, start, end)), record
    fired = {
        series["metric"]["alertname"]
        for series in prometheus.query_range("ALERTS", start, time.time())
    }
    assert {"KVCloudVerifyFailures", "KVCloudIndexBreakerOpen"} <= fired, fired
