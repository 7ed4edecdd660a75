"""API keys -> tenants: parsing, constant-time lookup, and the HTTP layer's use of them
(a real ``tiny`` engine behind FastAPI's TestClient, no store)."""

from __future__ import annotations

import hmac
import logging
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from fastapi.testclient import TestClient

from workers.cli import main as cli_main
from workers.config import WorkerOptions
from workers.engine import Engine
from workers.http import auth
from workers.http.auth import ApiKeyError, ApiKeys, bearer_token, load_api_keys
from workers.http.server import MAX_BODY_BYTES, create_app

KEY_A = "sk-alpha-" + secrets.token_hex(12)
KEY_A2 = "sk-alpha2-" + secrets.token_hex(12)  # a second key of the same tenant
KEY_B = "sk-beta-" + secrets.token_hex(12)
KEYS_ENV = f"{KEY_A}=alpha,{KEY_B}=beta,{KEY_A2}=alpha"
PROMPT = "The quick brown fox jumps over the lazy dog, twice over. " * 2  # several 16-token chunks
GEN = {"max_tokens": 2, "temperature": 0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tiny_options(**kw: Any) -> WorkerOptions:
    params: dict[str, Any] = dict(model="tiny", store=None, cache_pages=32, chunk_tokens=16)
    params.update(kw)
    return WorkerOptions(**params)


# -- parsing ----------------------------------------------------------------------------------


def test_keys_file_format_comments_and_env_merge(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# key  tenant\n\n{KEY_A}   alpha   # the first customer\n  {KEY_B}\tbeta\n")
    path.chmod(0o600)
    padded = "c2stZ2FtbWEta2V5LTEyMzQ1Ng=="  # base64 with '=' padding: split at the last '='
    keys = load_api_keys(str(path), f"{padded}=gamma, {KEY_A}=alpha")
    assert keys is not None and len(keys) == 3 and keys.warnings == ()
    assert keys.tenant_for_key(KEY_A) == "alpha"
    assert keys.tenant_for_key(KEY_B) == "beta"
    assert keys.tenant_for_key(padded) == "gamma"
    assert keys.tenant_for_key(KEY_A + "x") is None
    assert keys.tenant_for_key(KEY_A[:-1]) is None
    assert keys.tenant_for_key("") is None
    assert keys.tenants == {"alpha", "beta", "gamma"}
    assert load_api_keys(None, None) is None and load_api_keys(None, " ") is None


def test_bearer_header_parsing() -> None:
    assert bearer_token(f"Bearer {KEY_A}") == KEY_A
    assert bearer_token(f"bearer   {KEY_A} ") == KEY_A  # the scheme is case-insensitive
    for bad in (None, "", "Bearer", "Bearer ", f"Basic {KEY_A}", KEY_A, f"Token {KEY_A}"):
        assert bearer_token(bad) is None, bad


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{KEY_A}\n", "expected '<key> <tenant>'"),
        (f"{KEY_A} alpha extra\n", "expected '<key> <tenant>'"),
        (f"{KEY_A} al:pha\n", "a tenant must be"),
        (f"{KEY_A}é alpha\n", "an API key must be"),
        ("short alpha\n", "an API key must be"),
        (f"{KEY_A} alpha\n{KEY_A} beta\n", "already mapped to another tenant"),
        ("# only comments\n\n", "no API keys found"),
    ],
)
def test_bad_keys_file_is_an_error_that_never_echoes_a_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ApiKeyError, match=re.escape(message)) as info:
        load_api_keys(str(path), None)
    assert KEY_A not in str(info.value)
    assert "line" in str(info.value) or "no API keys" in str(info.value)


@pytest.mark.parametrize("value", [KEY_A, f"{KEY_A}=", f"={KEY_A}", f"{KEY_A}=a b", "short=x"])
def test_bad_keys_env_is_an_error_that_never_echoes_a_key(value: str) -> None:
    with pytest.raises(ApiKeyError) as info:
        load_api_keys(None, value)
    assert KEY_A not in str(info.value) and "short" not in str(info.value)


def test_unreadable_or_loose_keys_file(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match="cannot read API keys file"):
        load_api_keys(str(tmp_path / "missing"), None)
    with pytest.raises(ApiKeyError, match="not a regular file"):
        load_api_keys(str(tmp_path), None)
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} alpha\n")
    path.chmod(0o644)
    keys = load_api_keys(str(path), None)
    assert keys is not None and any("chmod 600" in w for w in keys.warnings)


def test_only_digests_are_held_and_nothing_prints_a_key() -> None:
    keys = load_api_keys(None, KEYS_ENV)
    assert keys is not None
    held = repr(keys) + str(keys.entries) + repr(keys.__dict__)
    assert KEY_A not in held and KEY_B not in held
    options = tiny_options(api_keys=KEYS_ENV)
    assert KEY_A not in repr(options) and KEY_A not in str(options)


def test_lookup_compares_every_key_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stored digest is compared with compare_digest, whether the key is first, last or
    absent: no early exit whose timing would say where (or whether) a key matched."""
    many = {f"sk-{i:04d}-" + secrets.token_hex(8): f"t{i % 3}" for i in range(50)}
    keys = ApiKeys.from_mapping(many)
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        assert isinstance(a, bytes) and isinstance(b, bytes) and len(a) == len(b) == 32
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    names = list(many)
    for key, want in ((names[0], "t0"), (names[-1], many[names[-1]]), ("sk-nope-" * 3, None)):
        calls.clear()
        assert keys.tenant_for_key(key) == want
        assert len(calls) == len(many)


# -- the HTTP layer, keys configured ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(tiny_options(worker_id="auth-test", api_keys=KEYS_ENV))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    # No `with`: the lifespan would close the shared engine at the end of each use.
    return TestClient(create_app(engine), raise_server_exceptions=False)


def _complete(client: TestClient, key: str, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={**GEN, **body}, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _assert_401(r: Any, *, missing: bool) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert ("missing" in err["message"]) is missing
    for key in (KEY_A, KEY_B, "sk-wrong"):
        assert key not in r.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/v1/sessions"),
        ("GET", "/v1/sessions/sess_" + "0" * 32),
        ("POST", "/v1/sessions/sess_" + "0" * 32 + "/flush"),
        ("GET", "/v1/no-such-path"),
    ],
)
def test_every_v1_endpoint_needs_a_known_key(client: TestClient, method: str, path: str) -> None:
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    _assert_401(client.request(method, path, json=body), missing=True)
    for header in (f"Bearer sk-wrong-{secrets.token_hex(8)}", f"Basic {KEY_A}", KEY_A, "Bearer"):
        r = client.request(method, path, json=body, headers={"Authorization": header})
        _assert_401(r, missing=False)


def test_401_comes_before_the_body_is_parsed_or_buffered(client: TestClient) -> None:
    # an unauthenticated caller learns nothing about validation and cannot make us buffer 16 MiB
    r = client.post("/v1/completions", content=b"{not json", headers={"X-Api-Key": KEY_A})
    _assert_401(r, missing=True)
    big = b"x" * (MAX_BODY_BYTES + 1)
    _assert_401(client.post("/v1/completions", content=big), missing=True)
    assert client.post("/v1/completions", content=big, headers=bearer(KEY_A)).status_code == 413


def test_probes_stay_open_and_say_nothing_about_keys(client: TestClient) -> None:
    for path in ("/healthz", "/metrics", "/openapi.json"):
        r = client.get(path)
        assert r.status_code == 200, path
        assert KEY_A not in r.text and KEY_B not in r.text


def test_openapi_declares_the_bearer_scheme(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    scheme = spec["components"]["securitySchemes"]["apiKey"]
    assert scheme == {**scheme, "type": "http", "scheme": "bearer"}
    for path, item in spec["paths"].items():
        for op in item.values():
            assert (op.get("security") == [{"apiKey": []}]) is path.startswith("/v1/"), path
            assert ("401" in op["responses"]) is path.startswith("/v1/"), path


def test_tenants_share_nothing_on_one_worker(client: TestClient) -> None:
    prompt = secrets.token_hex(4) + PROMPT  # fresh for this test: nothing cached yet
    first = _complete(client, KEY_A, prompt=prompt)["kvcloud"]
    assert first["tokens_local"] == 0
    # the same tenant through another of its keys hits its own pages ...
    again = _complete(client, KEY_A2, prompt=prompt)["kvcloud"]
    assert again["tokens_local"] >= 16 * 6
    # ... another tenant with the same prompt does not
    other = _complete(client, KEY_B, prompt=prompt)["kvcloud"]
    assert other["tokens_local"] == 0 and other["tokens_remote"] == 0
    assert other["tokens_computed"] == first["tokens_computed"]


def test_the_caller_cannot_choose_its_tenant(client: TestClient) -> None:
    """Only the key decides: tenant-looking body fields, headers and query parameters are
    ignored, so beta asking to be alpha still misses alpha's pages."""
    prompt = secrets.token_hex(4) + PROMPT  # a fresh first chunk: nothing cached
    _complete(client, KEY_A, prompt=prompt)
    disguises = {"tenant": "alpha", "tenant_id": "alpha", "user": "alpha", "salt": "00" * 32}
    r = client.post(
        "/v1/completions?tenant=alpha",
        json={**GEN, "prompt": prompt, **disguises},
        headers={
            **bearer(KEY_B),
            "X-Tenant": "alpha",
            "X-KVCloud-Tenant": "alpha",
            "OpenAI-Organization": "alpha",
        },
    )
    assert r.status_code == 200, r.text
    k = r.json()["kvcloud"]
    assert k["tokens_local"] == 0 and k["tokens_remote"] == 0
    # and alpha sending beta's name is still alpha: its own pages hit
    k = _complete(client, KEY_A, prompt=prompt, tenant="beta")["kvcloud"]
    assert k["tokens_local"] > 0


def test_sessions_are_scoped_to_their_tenant(client: TestClient) -> None:
    ids = set()
    for _ in range(20):
        r = client.post("/v1/sessions", headers=bearer(KEY_A))
        assert r.status_code == 201
        ids.add(r.json()["id"])
    assert len(ids) == 20
    assert all(re.fullmatch(r"sess_[0-9a-f]{32}", sid) for sid in ids)  # 128 random bits
    sid = ids.pop()
    _complete(client, KEY_A, prompt="first turn", session_id=sid)
    assert client.get(f"/v1/sessions/{sid}", headers=bearer(KEY_A)).json()["tokens"] > 0
    # beta knowing alpha's id is not enough: every use is "unknown session"
    for r in (
        client.get(f"/v1/sessions/{sid}", headers=bearer(KEY_B)),
        client.post(f"/v1/sessions/{sid}/flush", headers=bearer(KEY_B)),
        client.post(
            "/v1/completions",
            json={**GEN, "prompt": "hijack", "session_id": sid},
            headers=bearer(KEY_B),
        ),
        client.post(
            "/v1/chat/completions",
            json={**GEN, "messages": [{"role": "user", "content": "x"}], "session_id": sid},
            headers=bearer(KEY_B),
        ),
    ):
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "session_not_found"
    # ... and alpha's session is untouched (its other key is the same tenant)
    info = client.get(f"/v1/sessions/{sid}", headers=bearer(KEY_A2)).json()
    assert info["tokens"] > 0 and info["resident"] is True


def test_keys_never_reach_the_log(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    c = TestClient(create_app(engine), raise_server_exceptions=False)
    _complete(c, KEY_A, prompt="hello")
    c.post("/v1/completions", json={"prompt": "x"}, headers=bearer("sk-wrong-" + "9" * 16))
    c.post("/v1/completions", json={"prompt": 5}, headers=bearer(KEY_B))
    assert "API keys: 3 key(s) for 2 tenant(s)" in caplog.text
    for key in (KEY_A, KEY_B, KEY_A2, "sk-wrong-"):
        assert key not in caplog.text


# -- no keys configured: today's behaviour, with a warning ------------------------------------


def test_without_keys_every_request_is_the_configured_tenant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = Engine(tiny_options(worker_id="open", tenant="solo"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvcloud.worker.http"):
            c = TestClient(create_app(eng), raise_server_exceptions=False)
        warnings = [r for r in caplog.records if "no API keys configured" in r.getMessage()]
        assert len(warnings) == 1 and "'solo'" in warnings[0].getMessage()
        prompt = secrets.token_hex(4) + PROMPT  # a fresh first chunk: nothing cached
        r = c.post("/v1/completions", json={**GEN, "prompt": prompt})
        assert r.status_code == 200 and r.json()["kvcloud"]["tokens_local"] == 0
        # a key, or a tenant field, changes nothing: still tenant "solo", so its pages hit
        r = c.post(
            "/v1/completions",
            json={**GEN, "prompt": prompt, "tenant": "other"},
            headers={**bearer(KEY_B), "X-Tenant": "other"},
        )
        assert r.status_code == 200 and r.json()["kvcloud"]["tokens_local"] > 0
        sid = c.post("/v1/sessions").json()["id"]
        assert ("solo", sid) in eng.sessions
        spec = c.get("/openapi.json").json()
        assert "securitySchemes" not in spec.get("components", {})
    finally:
        eng.close()


# -- the command line -------------------------------------------------------------------------


def test_cli_rejects_a_bad_keys_file_without_printing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} alpha\n{KEY_B}\n")  # the second line lacks its tenant
    monkeypatch.delenv("KVCLOUD_API_KEYS", raising=False)
    code = cli_main(["serve", "--model", "tiny", "--port", "0", "--api-keys-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "line 2" in err and str(path) in err
    assert KEY_A not in err and KEY_B not in err
    monkeypatch.setenv("KVCLOUD_API_KEYS", f"{KEY_A}=bad tenant")
    assert cli_main(["serve", "--model", "tiny", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "KVCLOUD_API_KEYS item 1" in err and KEY_A not in err


def test_options_read_keys_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} alpha\n")
    env = {"KVCLOUD_API_KEYS_FILE": str(path), "KVCLOUD_API_KEYS": f"{KEY_B}=beta"}
    options = WorkerOptions.from_env(env, model="tiny")
    assert options.api_key_map is not None
    assert options.api_key_map.tenants == {"alpha", "beta"}
    assert options.api_key_map.sources == (str(path), "KVCLOUD_API_KEYS")
    assert WorkerOptions.from_env({}, model="tiny").api_key_map is None
