"""The HTTP API fuzzed from its own OpenAPI document with schemathesis: valid and invalid
requests to every operation of an in-process app (a real ``tiny`` engine, no store, API keys
on). No response may be a 5xx, and every response must match what the document promises
(status codes, content types, bodies), including the 401s of the bearer scheme."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance as ACCEPTANCE

from workers.config import WorkerOptions
from workers.engine import Engine
from workers.http.server import create_app

API_KEY = "sk-fuzz-" + secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 40  # per operation and generation mode; 7 operations stay well under 60 s


@pytest.fixture(scope="module")
def fuzz_app() -> Iterator[FastAPI]:
    # few pages and sessions: requests that fill them take the 503 and LRU paths too
    options = WorkerOptions(
        model="tiny",
        store=None,
        cache_pages=8,
        chunk_tokens=16,
        max_sessions=4,
        threads=1,
        worker_id="fuzz",
        api_keys=f"{API_KEY}=fuzz",
    )
    engine = Engine(options)
    yield create_app(engine)
    engine.close()


@pytest.fixture(scope="module")
def api_schema(fuzz_app: FastAPI) -> Any:
    # /openapi.json is what app.openapi() returns, served by the app itself
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    return schema


# (method, path) of every operation; test_every_operation_is_fuzzed keeps it complete. Listed
# here rather than read from the app because schemathesis's lazy pytest loader
# (schemathesis.pytest.from_fixture) does not work with pytest 9 (it sets Function._nodeid).
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("POST", "/v1/sessions/{session_id}/flush"),
    ("GET", "/healthz"),
    ("GET", "/metrics"),
]
NO_INPUT = {"/healthz", "/metrics"}  # nothing to make invalid: negative mode has no cases
CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode}")
    for method, path in OPERATIONS
    for mode in ("positive", "negative")
    if mode == "positive" or path not in NO_INPUT
]
# What valid data may still get: 404 for a session id that does not exist, and 400
# context_length_exceeded when prompt + max_tokens, each within its bound, do not fit together
# (in the model's context or this worker's KV cache) - a rule JSON Schema cannot state.
ACCEPTED = {200, 201, 404}


def _integral_floats_as_ints(value: Any) -> Any:
    """2.0 -> 2, recursively. JSON Schema's "integer" admits 2.0, and schemathesis generates it
    as valid data; the worker's contract is stricter on purpose (its body models are strict:
    2.0 is not a token id or a max_tokens, see tests/unit/test_server.py), which a schema cannot
    say. Positive cases therefore send integers as integers. Floats stay floats where they are
    meant (temperature accepts 2 as well as 2.0)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def test_every_operation_is_fuzzed(api_schema: Any) -> None:
    spec = {
        (method.upper(), path)
        for path, item in api_schema.raw_schema["paths"].items()
        for method in item
    }
    assert spec == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_api_conforms_to_its_openapi_document(
    api_schema: Any, method: str, path: str, mode: str
) -> None:
    operation = api_schema[path][method]
    positive = mode == "positive"

    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same cases every run: a failure here is reproducible
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # bounded time: no shrinking
    )
    def run(case: Any) -> None:
        if positive and case.body is not None:
            case.body = _integral_floats_as_ints(case.body)
        # every built-in check (no 5xx, status codes, content types and bodies as documented,
        # invalid data rejected, auth enforced), except the acceptance of valid data, which is
        # asserted below with the one exception the schema cannot express
        response = case.call_and_validate(headers=AUTH, excluded_checks=[ACCEPTANCE])
        if positive and response.status_code not in ACCEPTED:
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded", response.text

    run()


def test_a_request_bigger_than_the_kv_cache_is_400_not_503(fuzz_app: FastAPI) -> None:
    """Found by the fuzz test: a request needing more pages than the pool has got 503 "retry",
    which can never succeed. The exact fit still runs on an idle worker."""
    from fastapi.testclient import TestClient

    client = TestClient(fuzz_app, raise_server_exceptions=False)
    capacity = 8 * 16  # fuzz_app's cache_pages x chunk_tokens
    body = {"prompt": [65] * (capacity - 4), "max_tokens": 5, "ignore_eos": True}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "KV cache of 128 tokens" in r.json()["error"]["message"]
    for prompt in ([65] * (capacity - 4), "x" * (capacity - 5)):  # a text prompt adds BOS
        r = client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
