"""S3-specific behaviour: configuration, client settings, error mapping, secrets."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.stub import Stubber

from kvcloud.errors import ConfigError, ObjectNotFoundError, StoreError, StoreUnavailableError
from kvcloud.stores import S3Config, S3Store, open_store, s3_writes
from tests.servers import MotoServer, free_port

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"

_AWS_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_MAX_ATTEMPTS",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in _AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    s3_writes.forget()  # each test's server is new, whatever the endpoint says
    yield
    s3_writes.forget()


@pytest.fixture
def mock_s3() -> Iterator[None]:
    from moto import mock_aws

    with mock_aws():
        yield


def offline_store(**options: Any) -> S3Store:
    """A store whose client is built but never used for a request."""
    return S3Store(S3Config(bucket="bkt", endpoint_url="http://127.0.0.1:9", **options))


# -- S3Config ---------------------------------------------------------------------------------


def test_defaults() -> None:
    c = S3Config.from_url("s3://bucket", env={})
    assert c.bucket == "bucket"
    assert c.prefix == ""
    assert c.endpoint_url is None
    assert c.region == "us-east-1"
    assert c.addressing_style == "path"
    assert c.max_connections == 16
    assert c.connect_timeout == 2.0
    assert c.read_timeout == 10.0
    assert c.max_attempts == 5
    assert c.conditional_put == "auto"
    assert c.create_bucket is False


def test_url_parsing() -> None:
    c = S3Config.from_url(
        "s3://my-bucket/a/b/?endpoint_url=http://minio:9000&region=eu-west-1"
        "&addressing_style=virtual&max_connections=4&connect_timeout=0.5&read_timeout=3"
        "&max_attempts=2&conditional_put=false&create_bucket=1",
        env={},
    )
    assert c.bucket == "my-bucket"
    assert c.prefix == "a/b"
    assert c.endpoint_url == "http://minio:9000"
    assert c.region == "eu-west-1"
    assert c.addressing_style == "virtual"
    assert c.max_connections == 4
    assert c.connect_timeout == 0.5
    assert c.read_timeout == 3.0
    assert c.max_attempts == 2
    assert c.conditional_put == "off"
    assert c.create_bucket is True


def test_env_fills_in_what_the_url_leaves_out() -> None:
    env = {
        "AWS_ENDPOINT_URL": "http://generic:1",
        "AWS_ENDPOINT_URL_S3": "http://s3-specific:2",
        "AWS_DEFAULT_REGION": "ap-south-1",
        "AWS_REGION": "eu-north-1",
        "AWS_MAX_ATTEMPTS": "7",
    }
    c = S3Config.from_url("s3://b", env=env)
    assert c.endpoint_url == "http://s3-specific:2"  # the service-specific variable wins
    assert c.region == "eu-north-1"  # AWS_REGION over AWS_DEFAULT_REGION
    assert c.max_attempts == 7
    c = S3Config.from_url(
        "s3://b", env={"AWS_ENDPOINT_URL": "http://generic:1", "AWS_DEFAULT_REGION": "ap-south-1"}
    )
    assert c.endpoint_url == "http://generic:1"
    assert c.region == "ap-south-1"
    # The URL beats the environment, keyword overrides beat the URL.
    c = S3Config.from_url("s3://b?region=us-west-2&max_attempts=3", env=env, max_attempts=1)
    assert c.region == "us-west-2"
    assert c.max_attempts == 1
    assert c.endpoint_url == "http://s3-specific:2"


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "sa-east-1")
    assert S3Config.from_url("s3://b").region == "sa-east-1"


def test_none_overrides_are_ignored() -> None:
    assert S3Config.from_url("s3://b", env={}, region=None).region == "us-east-1"


@pytest.mark.parametrize(
    "url",
    [
        "file:///tmp/x",
        "s3://",
        "s3:///prefix",
        "s3://b?unknown=1",
        "s3://b?max_connections=many",
        "s3://b?max_connections=0",
        "s3://b?connect_timeout=-1",
        "s3://b?conditional_put=maybe",
        "s3://b?addressing_style=sideways",
        "s3://b?endpoint_url=ftp://host",
        "s3://b/../escape",
        "s3://b/a//b",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        S3Config.from_url(url, env={})


def test_unknown_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        S3Config.from_url("s3://b", env={}, bogus=1)


@pytest.mark.parametrize(
    "url",
    [
        f"s3://b?aws_secret_access_key={SECRET}",
        f"s3://b?secret_key={SECRET}",
        f"s3://AKIA:{SECRET}@b/prefix",
        f"s3://b?endpoint_url=http://minio:{SECRET}@host:9000",
    ],
)
def test_credentials_in_the_url_are_refused_without_echoing_them(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        S3Config.from_url(url, env={})
    assert SECRET not in str(info.value)
    assert "AWS_SECRET_ACCESS_KEY" in str(info.value) or "credentials" in str(info.value)


def test_config_url_is_canonical() -> None:
    c = S3Config(bucket="b", prefix="/p/q/", endpoint_url="http://h:1", region="eu-west-1")
    assert c.prefix == "p/q"
    assert c.url == "s3://b/p/q?endpoint_url=http://h:1&region=eu-west-1"
    assert S3Config.from_url(c.url, env={}) == c
    assert S3Config(bucket="b").url == "s3://b?region=us-east-1"


# -- botocore client settings ------------------------------------------------------------------


def test_client_settings() -> None:
    store = offline_store(max_connections=7, connect_timeout=0.25, read_timeout=3.5, max_attempts=4)
    try:
        cfg = store._client.meta.config
        assert cfg.s3 == {"addressing_style": "path", "payload_signing_enabled": False}
        assert cfg.request_checksum_calculation == "when_required"
        assert cfg.response_checksum_validation == "when_required"
        assert cfg.max_pool_connections == 7 == store.max_workers
        assert store.executor._max_workers == 7  # the pool threads match the connections
        assert cfg.connect_timeout == 0.25
        assert cfg.read_timeout == 3.5
        assert cfg.retries["mode"] == "standard"
        assert cfg.retries["total_max_attempts"] == 4  # first try included
        assert store._client.meta.region_name == "us-east-1"
        assert store._client.meta.endpoint_url == "http://127.0.0.1:9"
    finally:
        store.close()


def test_open_store_keywords_are_defaults_the_url_overrides() -> None:
    with open_store(
        "s3://b/p?endpoint_url=http://127.0.0.1:9",
        max_workers=8,
        connect_timeout=0.5,
        read_timeout=1.5,
    ) as store:
        assert isinstance(store, S3Store)
        assert store.max_workers == 8
        assert store.config.max_connections == 8
        assert store.config.connect_timeout == 0.5
        assert store.config.read_timeout == 1.5
        assert store.config.prefix == "p"
    with open_store(
        "s3://b?endpoint_url=http://127.0.0.1:9&max_connections=3&read_timeout=9",
        max_workers=8,
        read_timeout=1.5,
    ) as store:
        assert store.max_workers == 3
        assert store._client.meta.config.max_pool_connections == 3
        assert store.config.read_timeout == 9.0


def test_requests_use_path_style_and_send_if_none_match(moto_server: MotoServer) -> None:
    sent: list[tuple[str, str, dict[str, str]]] = []

    def capture(request: Any, **_: Any) -> None:
        headers = {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        sent.append((request.method, request.url, headers))

    url = moto_server.store_url("path-style-check", "pfx") + "&create_bucket=true"
    key_url = f"{moto_server.endpoint}/path-style-check/pfx/k/1"
    with S3Store.from_url(url) as store:
        store._client.meta.events.register("before-send.s3", capture)
        assert store.put("k/1", b"hello") is True
        assert store.put("k/1", b"hello") is False  # moto_server answers 412
        assert store.get("k/1") == b"hello"
        assert store.conditional_writes() == s3_writes.HONOURED
        # the probe's throwaway key is gone again
        assert [o.key for o in store.list()] == ["k/1"]
    # the first write probed the server: two conditional PUTs and a DELETE of one key
    probe = [(m, u) for m, u, _ in sent[:3]]
    assert [m for m, _ in probe] == ["PUT", "PUT", "DELETE"]
    assert probe[0][1].startswith(f"{moto_server.endpoint}/path-style-check/pfx/_kvcloud/")
    assert len({u for _, u in probe}) == 1
    mine = [(m, h) for m, u, h in sent if u == key_url]
    assert [m for m, _ in mine] == ["PUT", "PUT", "GET"]  # no HEAD: the server says 412
    assert all(h.get("If-None-Match") == "*" for m, h in mine if m == "PUT")
    # when_required: no flexible checksum computed for a plain PUT
    assert not any(h.lower().startswith("x-amz-checksum-") for h in mine[0][1])


def _serve_like(store: S3Store, behaviour: str) -> list[tuple[str, bool]]:
    """Make moto_server look like a server without conditional writes (a hook in the
    client: in-process moto would still apply a request the hook answers): ``refuse`` answers
    a PUT carrying If-None-Match with 501 NotImplemented (Swift s3api), ``ignore`` drops the
    header before it is sent (rclone serve s3). Returns (method, had If-None-Match) per
    request."""
    from botocore.awsrequest import AWSResponse

    seen: list[tuple[str, bool]] = []

    def hook(request: Any, **_: Any) -> Any:
        conditional = "If-None-Match" in request.headers
        seen.append((request.method, conditional))
        if conditional and behaviour == "refuse":
            body = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NotImplemented</Code>"
                b"<Message>A header you provided implies functionality that is not "
                b"implemented.</Message></Error>"
            )
            return AWSResponse(request.url, 501, {"Content-Type": "application/xml"}, _Raw(body))
        if conditional and behaviour == "ignore":
            del request.headers["If-None-Match"]
        return None

    store._client.meta.events.register_first("before-send.s3", hook)
    return seen


class _Raw:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data


@pytest.mark.parametrize(
    ("behaviour", "found"), [("refuse", s3_writes.REFUSED), ("ignore", s3_writes.IGNORED)]
)
def test_servers_without_conditional_writes_are_found_and_never_rewritten(
    moto_server: MotoServer, behaviour: str, found: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = moto_server.store_url("unconditional", f"p-{time.monotonic_ns()}")
    with S3Store.from_url(url + "&create_bucket=true") as store:
        seen = _serve_like(store, behaviour)
        with caplog.at_level("WARNING", logger="kvcloud.stores.s3"):
            assert store.put("k", b"one") is True
        assert store.conditional_writes() == found
        assert "HEAD before each write" in caplog.text
        probe_requests = len(seen)
        assert store.put("k", b"one") is False  # it exists, by HEAD: not written again
        assert store.get("k") == b"one"
        # after the probe: HEAD + PUT for the first write, HEAD alone for the second, no
        # conditional header ever again
        assert seen[probe_requests:] == [("HEAD", False), ("GET", False)]
        assert [o.key for o in store.list()] == ["k"]  # the probe key was deleted
    # the next store of this process for the same server does not probe again
    with S3Store.from_url(url) as store:
        seen = _serve_like(store, behaviour)
        assert store.put("k2", b"two") is True
        assert seen == [("HEAD", False), ("PUT", False)]


def test_a_501_after_a_good_probe_falls_back_without_failing_the_write(
    moto_server: MotoServer,
) -> None:
    url = moto_server.store_url("unconditional", f"p-{time.monotonic_ns()}")
    with S3Store.from_url(url + "&create_bucket=true&conditional_put=on") as store:
        seen = _serve_like(store, "refuse")
        assert store.put("k", b"one") is True  # 501, then HEAD, then a plain PUT
        assert seen == [("PUT", True), ("HEAD", False), ("PUT", False)]
        assert store.conditional_writes() == s3_writes.REFUSED
        assert store.put("k", b"one") is False
        assert store.get("k") == b"one"


def test_conditional_put_off_asks_with_head_first(mock_s3: None) -> None:
    sent: list[tuple[str, dict[str, str]]] = []
    with S3Store(S3Config(bucket="bkt", create_bucket=True, conditional_put=False)) as store:
        assert store.conditional_writes() == s3_writes.OFF

        def capture(request: Any, **_: Any) -> None:
            sent.append((request.method, dict(request.headers)))

        store._client.meta.events.register("before-send.s3", capture)
        assert store.put("k", b"one") is True
        assert store.put("k", b"two") is False  # HEAD found it: the first bytes stay
        assert store.get("k") == b"one"
    assert [m for m, _ in sent] == ["HEAD", "PUT", "HEAD", "GET"]
    assert all("If-None-Match" not in h for _, h in sent)


# -- error mapping ------------------------------------------------------------------------------


def stubbed(store: S3Store, method: str, code: str, status: int) -> Stubber:
    stub = Stubber(store._client)
    stub.add_client_error(method, service_error_code=code, http_status_code=status)
    stub.activate()
    return stub


@pytest.mark.parametrize(
    ("code", "status"), [("PreconditionFailed", 412), ("ConditionalRequestConflict", 409)]
)
def test_put_conflicts_mean_exists(code: str, status: int) -> None:
    # "on": trust the server's 412/409 (no probe, which the stub would have to answer)
    with offline_store(max_attempts=1, conditional_put="on") as store:
        stub = stubbed(store, "put_object", code, status)
        assert store.put("k", b"x") is False
        stub.assert_no_pending_responses()


@pytest.mark.parametrize(("code", "status"), [("SlowDown", 503), ("InternalError", 500)])
def test_server_errors_after_retries_are_unavailable(code: str, status: int) -> None:
    with offline_store(max_attempts=1) as store:
        stubbed(store, "get_object", code, status)
        with pytest.raises(StoreUnavailableError, match=code):
            store.get("k")


def test_access_denied_is_a_store_error_with_a_hint() -> None:
    with offline_store(max_attempts=1) as store:
        stubbed(store, "get_object", "AccessDenied", 403)
        with pytest.raises(StoreError, match="credentials") as info:
            store.get("k")
        assert not isinstance(info.value, StoreUnavailableError | ObjectNotFoundError)


def test_no_such_bucket_is_clear(mock_s3: None) -> None:
    with S3Store(S3Config(bucket="never-created", prefix="p")) as store:
        for op in (
            lambda: store.get("k"),
            lambda: store.put("k", b"x"),
            lambda: list(store.list()),
        ):
            with pytest.raises(StoreError) as info:
                op()
            assert not isinstance(info.value, ObjectNotFoundError)
            assert "never-created" in str(info.value)
            assert "does not exist" in str(info.value)
            assert "AWS S3" in str(info.value)  # where it looked


def test_no_such_bucket_names_the_endpoint(moto_server: MotoServer) -> None:
    with S3Store.from_url(moto_server.store_url("missing-bucket", "p")) as store:
        with pytest.raises(StoreError, match="does not exist") as info:
            store.get("k")
        assert moto_server.endpoint in str(info.value)
        assert "'k'" in str(info.value)
        assert "get" in str(info.value)


def test_create_bucket_is_idempotent(mock_s3: None) -> None:
    for created in (True, False):
        with S3Store(S3Config(bucket="made-here", create_bucket=True)) as store:
            assert store.put("k", b"x") is created
    with S3Store(S3Config(bucket="made-here", region="eu-west-1", create_bucket=True)) as store:
        assert store.get("k") == b"x"
    # Outside us-east-1 the bucket needs a LocationConstraint; creating one must work too.
    with S3Store(S3Config(bucket="made-in-eu", region="eu-west-1", create_bucket=True)) as store:
        assert store.put("k", b"y") is True


def test_closed_port_is_unavailable_quickly() -> None:
    port = free_port()  # nothing listens there
    url = (
        f"s3://bkt/p?endpoint_url=http://127.0.0.1:{port}"
        "&connect_timeout=0.5&read_timeout=0.5&max_attempts=1"
    )
    with open_store(url) as store:
        for name, op in [
            ("get", lambda: store.get("k")),
            ("put", lambda: store.put("k", b"x")),
            ("head", lambda: store.head("k")),
            ("delete", lambda: store.delete("k")),
            ("list", lambda: list(store.list())),
        ]:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError) as info:
                op()
            assert time.monotonic() - start < 10
            message = str(info.value)
            assert name in message and f"127.0.0.1:{port}" in message
        # The batch API hands the failure back instead of raising.
        assert all(isinstance(r, StoreUnavailableError) for r in store.get_many(["a", "b"]))


def test_unresponsive_server_times_out() -> None:
    # Accepts connections (the kernel's backlog does) but never answers: a read timeout.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        config = S3Config(
            bucket="bkt",
            endpoint_url=f"http://127.0.0.1:{port}",
            connect_timeout=0.5,
            read_timeout=0.3,
            max_attempts=2,
        )
        with S3Store(config) as store:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="ReadTimeout"):
                store.get("k")
            assert time.monotonic() - start < 10


# -- secrets ----------------------------------------------------------------------------------


def test_no_secret_in_url_repr_or_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    port = free_port()
    store = open_store(f"s3://bkt/p?endpoint_url=http://127.0.0.1:{port}&max_attempts=1")
    with store:
        texts = [store.url, repr(store), repr(store.config), str(store.config)]
        with pytest.raises(StoreUnavailableError) as info:
            store.get("k")
        texts += [str(info.value), repr(info.value)]
    for text in texts:
        assert SECRET not in text
    assert store.url == f"s3://bkt/p?endpoint_url=http://127.0.0.1:{port}&region=us-east-1"


def test_missing_boto3_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` fail
    config = S3Config.from_url("s3://b/p", env={})  # parsing needs no boto3
    with pytest.raises(ConfigError, match=r"pip install kvcloud\[s3\]"):
        S3Store(config)
    with pytest.raises(ConfigError, match=r"kvcloud\[s3\]"):
        open_store("s3://b/p")


def test_payload_signing_is_optional_and_puts_still_work(moto_server) -> None:  # type: ignore[no-untyped-def]
    """Unsigned payloads are the default (objects verify themselves); signed ones work too."""
    import uuid

    from kvcloud.stores import open_store

    for sign in ("false", "true"):
        url = (
            f"{moto_server.store_url('kvcloud', f'sig-{uuid.uuid4().hex[:8]}')}"
            f"&create_bucket=true&sign_payload={sign}"
        )
        with open_store(url) as store:
            assert store.config.botocore_config().s3["payload_signing_enabled"] is (sign == "true")
            assert store.put("a/b", bytearray(b"x" * 100_000))
            assert store.get("a/b") == b"x" * 100_000
