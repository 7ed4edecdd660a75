"""Secrets never leave the process: the master secret, S3 keys, the Redis password and API keys
do not appear in a worker's log, in any response (bodies and headers, errors included), in
``/metrics`` or ``/healthz`` - while it serves good and bad requests, loses its store, and is
stopped with SIGTERM. Nor does the ``kvcloud`` CLI print a Redis password when it cannot
connect or authenticate."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import WorkerProc
from tests.servers import MotoServer, RedisServer, free_port
from workers.http.auth import CredentialRedactor

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MASTER_SECRET = "kvc-master-" + secrets.token_hex(16)
AWS_KEY_ID = "AKIAKVC" + secrets.token_hex(8).upper()
AWS_SECRET = "aws-secret-" + secrets.token_hex(16)
REDIS_PASSWORD = "redis-pw-" + secrets.token_hex(12)
WRONG_REDIS_PASSWORD = "redis-wrong-" + secrets.token_hex(12)
KEY_A = "sk-alpha-" + secrets.token_hex(16)  # from the keys file
KEY_B = "sk-beta-" + secrets.token_hex(16)  # from KVCLOUD_API_KEYS
WRONG_KEY = "sk-wrong-" + secrets.token_hex(16)  # what an attacker sends
SECRETS = {
    "KVCLOUD_SECRET": MASTER_SECRET,
    "AWS_ACCESS_KEY_ID": AWS_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
    "Redis password": REDIS_PASSWORD,
    "wrong Redis password": WRONG_REDIS_PASSWORD,
    "API key A": KEY_A,
    "API key B": KEY_B,
    "wrong API key": WRONG_KEY,
}


def leaks(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text]


def start_redis_with_password(workdir: Path, password: str) -> RedisServer:
    """tests.servers.start_redis with ``requirepass``, set in a config file so the password
    is not on the command line (where ps shows it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not found")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = workdir / "redis.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\nsave ''\nappendonly no\n"
        f"protected-mode no\ndaemonize no\nrequirepass {password}\n"
    )
    conf.chmod(0o600)
    server = RedisServer(argv=[binary, str(conf)], port=port, log_path=workdir / "redis.log")
    return server.start()  # type: ignore[return-value]


@pytest.fixture(scope="module")
def redis_pw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis_with_password(tmp_path_factory.mktemp("redis-pw"), REDIS_PASSWORD)
    yield server
    server.stop()


class Exchanges:
    """Every response a test saw, headers and body, to search for secrets at the end."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def add(self, r: httpx.Response) -> httpx.Response:
        headers = "\n".join(f"{k}: {v}" for k, v in r.headers.items())
        self.texts.append(f"{r.request.method} {r.request.url} -> {r.status_code}\n{headers}\n")
        self.texts.append(r.text)
        return r


def exercise(w: WorkerProc, seen: Exchanges, *, store_works: bool) -> None:
    c = w.client
    ok = {"Authorization": f"Bearer {KEY_A}"}
    ok_b = {"Authorization": f"Bearer {KEY_B}"}
    gen = {"max_tokens": 3, "temperature": 0}
    long_prompt = "secret-free prompt text, long enough for several chunks. " * 3

    def req(method: str, path: str, want: int | set[int], **kw: object) -> httpx.Response:
        r = seen.add(c.request(method, path, **kw))  # type: ignore[arg-type]
        assert r.status_code in ({want} if isinstance(want, int) else want), (path, r.text)
        return r

    # good requests, for both tenants
    req("POST", "/v1/completions", 200, json={**gen, "prompt": long_prompt}, headers=ok)
    req("POST", "/v1/completions", 200, json={**gen, "prompt": long_prompt}, headers=ok_b)
    chat = {**gen, "messages": [{"role": "user", "content": "hi"}]}
    req("POST", "/v1/chat/completions", 200, json=chat, headers=ok_b)
    req("GET", "/v1/models", 200, headers=ok)
    sid = req("POST", "/v1/sessions", 201, headers=ok).json()["id"]
    req("POST", "/v1/completions", 200, json={**gen, "prompt": "t1", "session_id": sid}, headers=ok)
    req("POST", f"/v1/sessions/{sid}/flush", 200 if store_works else 503, headers=ok)
    req("GET", f"/v1/sessions/{sid}", 200, headers=ok)
    # bad requests
    req("POST", "/v1/completions", 400, content=b'{"prompt": ', headers=ok)
    req("POST", "/v1/completions", 400, json={"prompt": "x", "max_tokens": 0}, headers=ok)
    req("POST", "/v1/completions", 400, json={"prompt": "x" * 5000}, headers=ok)
    req("POST", "/v1/completions", 400, json={"prompt": [1, 2, 99999]}, headers=ok)
    # an unknown session is 404; without an index it may be 503 (cannot tell) instead
    unknown = {404} if store_works else {404, 503}
    body = {"prompt": "x", "session_id": "sess_nope"}
    req("POST", "/v1/completions", unknown, json=body, headers=ok)
    req("GET", "/v1/sessions/sess_" + "0" * 32, unknown, headers=ok)
    req("GET", f"/v1/sessions/{sid}", unknown, headers=ok_b)  # another tenant's session
    req("GET", "/v1/sessions/bad:id", 400, headers=ok)
    req("DELETE", "/v1/completions", 405, headers=ok)
    req("GET", "/nowhere", 404)
    req("POST", "/v1/completions", 413, content=b"x" * (17 * 2**20), headers=ok)
    # wrong and missing API keys, including one that echoes a secret at us
    req("POST", "/v1/completions", 401, json={"prompt": "x"})
    req("POST", "/v1/completions", 401, json={"prompt": "x"}, headers={"Authorization": WRONG_KEY})
    for guess in (WRONG_KEY, MASTER_SECRET, REDIS_PASSWORD, KEY_A[:-1]):
        req("GET", "/v1/models", 401, headers={"Authorization": f"Bearer {guess}"})
    # probes
    req("GET", "/healthz", 200)
    req("GET", "/metrics", 200)
    req("GET", "/openapi.json", 200)


def test_a_worker_never_shows_its_secrets(
    spawn: Callable[..., WorkerProc],
    moto_server: MotoServer,
    redis_pw: RedisServer,
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"# test keys\n{KEY_A} alpha\n")
    keys_file.chmod(0o600)
    env = {
        "KVCLOUD_SECRET": MASTER_SECRET,
        "AWS_ACCESS_KEY_ID": AWS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
        "KVCLOUD_API_KEYS": f"{KEY_B}=beta",
        "KVCLOUD_API_KEYS_FILE": str(keys_file),
        # in the environment, not on the command line: the URL holds the password
        "KVCLOUD_INDEX": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_pw.port}/0",
    }
    good_store = moto_server.store_url(prefix="secrets") + "&create_bucket=true"
    dead = free_port()  # nothing listens there: every store call fails to connect
    dead_store = f"s3://kvcloud/secrets?endpoint_url=http://127.0.0.1:{dead}&region=us-east-1"
    seen = Exchanges()

    # a worker whose store and index work, logging at DEBUG: botocore then prints every
    # request's headers, the SigV4 Authorization header (access key id) among them
    w = spawn("secrets-ok", good_store, None, env=env, extra=["--log-level", "debug"])
    exercise(w, seen, store_works=True)
    assert w.stop(signal.SIGTERM) in (0, -signal.SIGTERM)

    # a worker whose store is unreachable and whose index refuses its password
    bad_index = f"redis://:{WRONG_REDIS_PASSWORD}@127.0.0.1:{redis_pw.port}/0"
    w2 = spawn(
        "secrets-down",
        dead_store,
        None,
        env={**env, "KVCLOUD_INDEX": bad_index, "KVCLOUD_REMOTE_TIMEOUT": "0.5"},
    )
    exercise(w2, seen, store_works=False)
    assert w2.stop(signal.SIGTERM) in (0, -signal.SIGTERM)

    for worker in (w, w2):
        log = worker.log_path.read_text(errors="replace")
        assert leaks(log) == [], f"{worker.name} log:\n{log[-4000:]}"
        assert "ready on" in log and "shutdown" in log, log[-2000:]  # it did log its work
        if worker is w:
            assert "Credential=***" in log  # botocore's debug output was there, masked
        assert not [a for a in worker.argv if leaks(a)]
    assert "flush failed" in "".join(seen.texts)  # the down worker's 503 was captured
    for text in seen.texts:
        assert leaks(text) == [], text[:2000]


def _kvcloud_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVCLOUD_SECRET": MASTER_SECRET}
    env.pop("KVCLOUD_INDEX", None)
    env.pop("KVCLOUD_STORE", None)
    return subprocess.run(
        [sys.executable, "-m", "kvcloud.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )


@pytest.mark.parametrize("json_output", [False, True])
def test_kvcloud_cli_never_prints_the_redis_password(
    redis_pw: RedisServer, json_output: bool
) -> None:
    dead = free_port()
    targets = {
        "dead port": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{dead}/0",
        "wrong password": f"redis://:{WRONG_REDIS_PASSWORD}@127.0.0.1:{redis_pw.port}/0",
        "user and wrong password": (
            f"redis://default:{WRONG_REDIS_PASSWORD}@127.0.0.1:{redis_pw.port}/0"
        ),
    }
    for what, url in targets.items():
        res = _kvcloud_cli("stats", "--index", url, "--no-store", *(["--json"] * json_output))
        out = res.stdout + res.stderr
        assert res.returncode != 0, (what, out)
        assert out.strip(), what  # it said something about the failure
        assert "Traceback" not in out, out
        assert leaks(out) == [], (what, out)
    # the right password works, and its output does not show it either
    good = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_pw.port}/0"
    res = _kvcloud_cli("stats", "--index", good, "--no-store", *(["--json"] * json_output))
    assert res.returncode == 0, res.stderr
    assert leaks(res.stdout + res.stderr) == [], res.stdout + res.stderr


def test_credential_redactor_masks_sigv4_and_session_tokens() -> None:
    token = "FwoGZXIvYXdzE" + secrets.token_hex(20)
    msg = (
        "Sending http request: <AWSPreparedRequest headers={'X-Amz-Security-Token': b'%s', "
        "'Authorization': b'AWS4-HMAC-SHA256 Credential=%s/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=%s'}>"
    )
    signature = secrets.token_hex(32)
    record = logging.LogRecord(
        "botocore.endpoint", logging.DEBUG, __file__, 1, msg, (token, AWS_KEY_ID, signature), None
    )
    assert CredentialRedactor().filter(record)
    text = record.getMessage()
    assert token not in text and AWS_KEY_ID not in text and signature not in text
    assert "Credential=***/20260101" in text and "SignedHeaders=host" in text
