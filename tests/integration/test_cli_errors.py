"""Every ``kvcloud`` command, against every way a deployment is commonly misconfigured, ends
in one clear line instead of a traceback: the URL without its secrets and what to check.

Real servers: a password-protected ``redis-server``, and a ``moto_server`` that enforces
IAM authentication (``INITIAL_NO_AUTH_ACTION_COUNT``), so wrong S3 credentials are refused
the way AWS and MinIO refuse them (InvalidAccessKeyId, SignatureDoesNotMatch).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from kvcloud import KVCloud
from kvcloud.indexes import SQLiteIndex
from kvcloud.tools.cli import main
from tests.helpers import make_kv, make_ns, make_tokens
from tests.servers import MotoServer, RedisServer, free_port, start_redis

REDIS_PASSWORD = "redis-pw-7f3a9c"
WRONG_SECRET = "wrong-secret-b81e44"
BUCKET = "kvcloud-cli"


@dataclass
class AuthS3:
    server: MotoServer
    key_id: str
    secret: str

    def url(self, bucket: str = BUCKET) -> str:
        return f"s3://{bucket}/p?endpoint_url={self.server.endpoint}&region=us-east-1"


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthS3]:
    """moto_server that lets 3 unauthenticated calls through (to create an IAM user, its
    key and policy), then checks every request's signature against IAM."""
    work = tmp_path_factory.mktemp("auth-moto")
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    argv = ["env", "INITIAL_NO_AUTH_ACTION_COUNT=3", str(exe), "-H", "127.0.0.1"]
    server = MotoServer(
        argv=[*argv, "-p", str(port)],
        port=port,
        log_path=work / "moto.log",
    )
    server.start()
    try:
        anon = {"aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
        kw = {"endpoint_url": server.endpoint, "region_name": "us-east-1"}
        iam = boto3.client("iam", **kw, **anon)
        iam.create_user(UserName="kvcloud")
        key = iam.create_access_key(UserName="kvcloud")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*"}]}
        policy["Statement"][0]["Resource"] = "*"
        iam.put_user_policy(UserName="kvcloud", PolicyName="all", PolicyDocument=json.dumps(policy))
        good = {
            "aws_access_key_id": key["AccessKeyId"],
            "aws_secret_access_key": key["SecretAccessKey"],
        }
        boto3.client("s3", **kw, **good).create_bucket(Bucket=BUCKET)
        yield AuthS3(server, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(
        tmp_path_factory.mktemp("auth-redis"), extra=["--requirepass", REDIS_PASSWORD]
    )
    yield server
    server.stop()


@dataclass
class Scenario:
    name: str
    breaks: str  # "store" or "index": which backend is misconfigured
    # what the one line must say (case-insensitive; "A|B": either). A HEAD request's 403
    # has no body, so doctor's bucket check can only say 403 where other commands name the
    # S3 error code.
    hints: tuple[str, ...]
    secrets: tuple[str, ...]  # what it must never say


def _scenario_setup(
    name: str, tmp_path: Path, auth_s3: AuthS3, auth_redis: RedisServer, mp: pytest.MonkeyPatch
) -> tuple[str, str, Scenario]:
    file_store = f"file://{tmp_path / 'objects'}"
    sqlite_index = f"sqlite://{tmp_path / 'index.db'}"
    # the commands read existing backends and never create them: make the good ones
    (tmp_path / "objects").mkdir()
    SQLiteIndex(tmp_path / "index.db").close()
    good_redis = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{auth_redis.port}/0"
    mp.setenv("KVCLOUD_CONNECT_TIMEOUT", "0.5")
    mp.setenv("AWS_ACCESS_KEY_ID", auth_s3.key_id)
    mp.setenv("AWS_SECRET_ACCESS_KEY", auth_s3.secret)
    mp.delenv("AWS_PROFILE", raising=False)
    secrets = (REDIS_PASSWORD, WRONG_SECRET, auth_s3.secret)
    if name == "index-down":
        index = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"
        return file_store, index, Scenario(name, "index", ("unreachable", "check"), secrets)
    if name == "redis-wrong-password":
        index = f"redis://:{WRONG_SECRET}@127.0.0.1:{auth_redis.port}/0"
        return (
            file_store,
            index,
            Scenario(name, "index", ("redis://:***@", "password"), secrets),
        )
    if name == "store-down":
        store = f"s3://{BUCKET}/p?endpoint_url=http://127.0.0.1:{free_port()}&region=us-east-1"
        return store, good_redis, Scenario(name, "store", ("cannot reach", "check"), secrets)
    if name == "s3-wrong-secret":
        mp.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
        return (
            auth_s3.url(),
            sqlite_index,
            Scenario(name, "store", ("SignatureDoesNotMatch|403", "credentials"), secrets),
        )
    if name == "s3-unknown-key":
        mp.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        return (
            auth_s3.url(),
            sqlite_index,
            Scenario(name, "store", ("InvalidAccessKeyId|403", "credentials"), secrets),
        )
    if name == "bucket-missing":
        return (
            auth_s3.url("kvcloud-no-such-bucket"),
            sqlite_index,
            Scenario(name, "store", ("does not exist", "create"), secrets),
        )
    raise AssertionError(name)


# scenario -> the backend it breaks
SCENARIOS = {
    "index-down": "index",
    "redis-wrong-password": "index",
    "store-down": "store",
    "s3-wrong-secret": "store",
    "s3-unknown-key": "store",
    "bucket-missing": "store",
}
FP = "ab" * 32
KEY = f"{'0' * 32}/ab/{'ab' * 32}"
# (argv, which backends the command touches)
COMMANDS: list[tuple[list[str], set[str]]] = [
    (["stats"], {"store", "index"}),
    (["stats", "--prometheus"], {"store", "index"}),
    (["stats", "--json"], {"store", "index"}),
    (["ls"], {"index"}),
    (["ls", "--json"], {"index"}),
    (["inspect", FP], {"index"}),
    (["inspect", KEY, "--json"], {"store"}),
    (["verify"], {"store", "index"}),
    (["verify", "--deep", "--json"], {"store", "index"}),
    (["gc", "--dry-run"], {"store", "index"}),
    (["gc", "--json"], {"store", "index"}),
    (["doctor"], {"store", "index"}),
    (["doctor", "--json"], {"store", "index"}),
    (["bench", "store", "--chunks", "2", "--repeat", "1", "--lookup-iters", "2"], {"store"}),
]
# bench store needs both, but its first failure is always the store's (it pushes before it
# looks anything up), so only the store scenarios are asserted for it
CASES = [
    pytest.param(argv, name, id=f"{' '.join(argv[:2])}-{name}")
    for argv, touches in COMMANDS
    for name, breaks in SCENARIOS.items()
    if breaks in touches
]


@pytest.mark.parametrize("argv, scenario", CASES)
def test_every_command_fails_in_one_clear_line(
    argv: list[str],
    scenario: str,
    tmp_path: Path,
    auth_s3: AuthS3,
    auth_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, index, sc = _scenario_setup(scenario, tmp_path, auth_s3, auth_redis, monkeypatch)
    # An uncaught exception here fails the test: that is the traceback a user would see.
    rc = main([*argv, "--store", store, "--index", index])
    out, err = capsys.readouterr()
    for secret in sc.secrets:
        assert secret not in out + err
    if argv[0] == "doctor":
        # doctor reports instead of failing: exit 1 and a FAIL check naming the problem
        assert rc == 1
        if "--json" in argv:
            checks = json.loads(out)["checks"]
            text = " ".join(f"{c['detail']} {c['fix']}" for c in checks if c["status"] == "FAIL")
        else:
            text = " ".join(line for line in out.splitlines() if line.startswith("FAIL"))
        assert text, out
    else:
        assert rc == 2, (out, err)
        lines = err.strip().splitlines()
        text = lines[-1]
        assert text.startswith(f"kvcloud {argv[0]}: error: "), err
        assert "Traceback" not in err, err
        if "--json" in argv or "--prometheus" in argv:
            assert out == "", "nothing half-written on stdout for scripts"
    low = text.lower()
    for hint in sc.hints:
        assert any(h.lower() in low for h in hint.split("|")), f"{hint!r} not in: {text}"


def test_the_same_commands_succeed_with_the_right_settings(
    tmp_path: Path,
    auth_s3: AuthS3,
    auth_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The control: with correct credentials every command above exits 0, so the failures
    are the misconfiguration's and not the commands' own."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", auth_s3.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", auth_s3.secret)
    store = auth_s3.url()
    index = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{auth_redis.port}/0"
    ns = make_ns()
    with KVCloud.open(store=store, index=index) as kv:
        toks = make_tokens(32)
        res = kv.push(ns, toks, make_kv(ns, 32))
        fp = kv.fingerprints(ns, toks)[0].hex()
    for argv, _ in COMMANDS:
        argv = [fp if a == FP else res.keys[0] if a == KEY else a for a in argv]
        rc = main([*argv, "--store", store, "--index", index])
        out, err = capsys.readouterr()
        assert rc == 0, (argv, out, err)
        assert REDIS_PASSWORD not in out + err and auth_s3.secret not in out + err
