"""The worker's HTTP layer against a real ``tiny`` engine, through FastAPI's TestClient."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from fastapi.testclient import TestClient

from workers.cli import main as cli_main
from workers.config import WorkerOptions
from workers.engine import Engine
from workers.errors import CacheFullError
from workers.http.server import MAX_BODY_BYTES, create_app

REPO = Path(__file__).resolve().parents[2]
UNKNOWN_SESSION = "sess_" + "0" * 32
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 2  # > one 16-token chunk


def tiny_options(**kw: Any) -> WorkerOptions:
    params: dict[str, Any] = dict(model="tiny", store=None, cache_pages=16, chunk_tokens=16)
    params.update(kw)
    return WorkerOptions(**params)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(tiny_options(worker_id="test-worker"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    # No `with`: the lifespan (flush + close on shutdown) would end the shared engine;
    # test_shutdown_flushes_sessions_and_closes_the_engine covers it with its own engine.
    return TestClient(create_app(engine), raise_server_exceptions=False)


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"message", "type", "code"} <= set(err)
    assert "Traceback" not in r.text
    return err


# -- completions ------------------------------------------------------------------------------


def test_completion_shape_and_usage(client: TestClient, engine: Engine) -> None:
    d = complete(client, prompt="hello world", max_tokens=5, model="anything")
    assert re.fullmatch(r"cmpl-[0-9a-f]+", d["id"])
    assert d["object"] == "text_completion"
    assert d["model"] == "anything"
    assert isinstance(d["created"], int) and abs(d["created"] - time.time()) < 60
    [choice] = d["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["text"], str)
    assert "token_ids" not in choice  # only on request

    usage, kv = d["usage"], d["kvcloud"]
    n_prompt = len(engine.tokenizer.encode("hello world")) + 1  # BOS
    assert usage["prompt_tokens"] == n_prompt
    assert 1 <= usage["completion_tokens"] <= 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == kv["tokens_local"] + kv["tokens_remote"]
    assert kv["tokens_local"] + kv["tokens_remote"] + kv["tokens_computed"] == n_prompt
    assert kv["tokens_remote"] == 0  # no store
    assert kv["ttft_ms"] >= 0 and kv["total_ms"] >= kv["ttft_ms"]
    assert kv["session_tokens"] == 0 and kv["session_id"] is None
    assert kv["worker_id"] == "test-worker"

    d = complete(client, prompt="hello world", max_tokens=5)
    assert d["model"] == engine.model_name  # echoes the engine's model when none is given


def test_return_token_ids_and_max_tokens(client: TestClient, engine: Engine) -> None:
    d = complete(client, prompt="abc", max_tokens=7, return_token_ids=True, ignore_eos=True)
    ids = d["choices"][0]["token_ids"]
    assert len(ids) == 7 == d["usage"]["completion_tokens"]  # ignore_eos: never stops early
    assert d["choices"][0]["finish_reason"] == "length"
    assert all(isinstance(t, int) and 0 <= t < engine.tokenizer.vocab_size for t in ids)
    assert d["choices"][0]["text"] == engine.tokenizer.decode(ids)


def test_token_id_prompt_is_used_as_given(client: TestClient, engine: Engine) -> None:
    tok = engine.tokenizer
    text = complete(client, prompt="token ids", max_tokens=6, return_token_ids=True)
    ids = [tok.bos_id, *tok.encode("token ids")]
    by_ids = complete(client, prompt=ids, max_tokens=6, return_token_ids=True)
    # a text prompt gets BOS; the same ids given explicitly are the same model input
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["choices"][0]["token_ids"] == text["choices"][0]["token_ids"]
    no_bos = complete(client, prompt=tok.encode("token ids"), max_tokens=1)
    assert no_bos["usage"]["prompt_tokens"] == len(ids) - 1  # no BOS added to token ids


def test_greedy_is_deterministic(client: TestClient) -> None:
    body = dict(prompt="determinism", max_tokens=12, return_token_ids=True, ignore_eos=True)
    a, b = complete(client, **body), complete(client, **body)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    # the second run found the prompt's pages cached and must not change the output
    explicit = complete(client, **body, temperature=0)
    assert explicit["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]


def test_seed_makes_sampling_reproducible(client: TestClient) -> None:
    body = dict(prompt="sampling", max_tokens=16, temperature=1.0, ignore_eos=True)

    def ids(seed: int) -> list[int]:
        return complete(client, **body, seed=seed, return_token_ids=True)["choices"][0]["token_ids"]

    assert ids(7) == ids(7)
    assert len({tuple(ids(s)) for s in (1, 2, 3)}) > 1  # the seed does steer sampling


# -- chat -------------------------------------------------------------------------------------


def test_chat_completion_shape(client: TestClient, engine: Engine) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", d["id"])
    assert d["object"] == "chat.completion" and d["model"] == engine.model_name
    [choice] = d["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == engine.tokenizer.decode(choice["token_ids"])
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    from workers.engine.tokenizer import apply_chat_template

    n_prompt = len(engine.tokenizer.encode(apply_chat_template(messages))) + 1  # BOS
    assert d["usage"]["prompt_tokens"] == n_prompt
    assert d["kvcloud"]["tokens_computed"] <= n_prompt

    # OpenAI's content parts and max_completion_tokens are understood
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
    ]
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [messages[0], *parts],
            "max_tokens": 9,
            "max_completion_tokens": 2,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n_prompt
    assert len(r.json()["choices"][0]["token_ids"]) <= 2


def test_chat_turns_in_a_session_render_the_whole_conversation(client: TestClient) -> None:
    sid = client.post("/v1/sessions").json()["id"]
    turn = {"max_tokens": 4, "session_id": sid, "ignore_eos": True}
    first = client.post(
        "/v1/chat/completions", json={**turn, "messages": [{"role": "user", "content": LONG_TEXT}]}
    ).json()
    second = client.post(
        "/v1/chat/completions", json={**turn, "messages": [{"role": "user", "content": "More."}]}
    ).json()
    assert first["kvcloud"]["session_id"] == sid == second["kvcloud"]["session_id"]
    # the input is the template over the whole conversation, the reply as generated included
    reply = first["choices"][0]["message"]["content"]
    whole = [
        {"role": "user", "content": LONG_TEXT},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "More."},
    ]
    stateless = client.post(
        "/v1/chat/completions", json={"max_tokens": 4, "ignore_eos": True, "messages": whole}
    ).json()
    assert second["usage"]["prompt_tokens"] == stateless["usage"]["prompt_tokens"]
    assert second["choices"][0]["message"] == stateless["choices"][0]["message"]
    assert second["kvcloud"]["session_tokens"] == second["usage"]["total_tokens"]
    assert second["kvcloud"]["tokens_local"] > 0


# -- sessions ---------------------------------------------------------------------------------


def test_session_lifecycle_without_a_store(client: TestClient) -> None:
    r = client.post("/v1/sessions")
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert re.fullmatch(r"[A-Za-z0-9_-]+", sid) and len(sid) >= 22  # >= 128 random bits

    one = complete(client, prompt=LONG_TEXT, max_tokens=6, session_id=sid, ignore_eos=True)
    assert one["kvcloud"]["session_id"] == sid
    assert one["kvcloud"]["session_tokens"] == one["usage"]["total_tokens"]

    two = complete(client, prompt=" And then?", max_tokens=6, session_id=sid, ignore_eos=True)
    n_new = len(b" And then?")
    assert two["usage"]["prompt_tokens"] == one["kvcloud"]["session_tokens"] + n_new
    assert two["kvcloud"]["session_tokens"] > one["kvcloud"]["session_tokens"]
    assert two["kvcloud"]["tokens_local"] > 0  # the history's KV stayed in this worker
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    info = client.get(f"/v1/sessions/{sid}")
    assert info.status_code == 200, info.text
    i = info.json()
    assert i["session_id"] == sid
    assert i["tokens"] == two["kvcloud"]["session_tokens"]
    assert i["resident"] is True and i["stored"] is False
    assert 0 < i["kv_tokens"] <= i["tokens"]

    f = client.post(f"/v1/sessions/{sid}/flush")
    assert f.status_code == 200, f.text
    assert f.json() == {
        "session_id": sid,
        "tokens": i["tokens"],
        "kv_tokens": 0,
        "chunks_pushed": 0,
        "bytes_pushed": 0,
        "stored": False,
    }


def test_unknown_session_is_404(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "session_id": UNKNOWN_SESSION})
    assert error_of(r, 404)["code"] == "session_not_found"
    assert error_of(client.get(f"/v1/sessions/{UNKNOWN_SESSION}"), 404)["code"] == (
        "session_not_found"
    )
    error_of(client.post(f"/v1/sessions/{UNKNOWN_SESSION}/flush"), 404)
    chat = {"messages": [{"role": "user", "content": "x"}], "session_id": UNKNOWN_SESSION}
    error_of(client.post("/v1/chat/completions", json=chat), 404)


# -- bad requests -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "seed": "7"}, "seed"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "x", "session_id": 5}, "session_id"),
        ({"prompt": "x", "session_id": "../../etc/passwd"}, "session_id"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": 3}},
            "stream_options.include_usage",
        ),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt.1"),
        ({"prompt": [1, 2.5]}, "prompt.1"),
        ({"prompt": None}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_bodies_are_400(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    err = error_of(client.post("/v1/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param.split(".")[0] in err["message"]


def test_token_id_out_of_range_is_400(client: TestClient, engine: Engine) -> None:
    vocab = engine.tokenizer.vocab_size
    for bad in (vocab, -1, 10**30):
        err = error_of(client.post("/v1/completions", json={"prompt": [1, bad, 2]}), 400)
        assert err["param"] == "prompt.1"
        # a list that fails inside is not also told it should have been a string
        assert "string" not in err["message"]


def test_prompt_longer_than_the_context_is_400(client: TestClient, engine: Engine) -> None:
    n = engine.max_context
    err = error_of(client.post("/v1/completions", json={"prompt": "x" * n, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded"
    assert str(n) in err["message"]
    # fits alone, but not with the tokens asked for
    body = {"prompt": [65] * (n - 10), "max_tokens": 11}
    assert error_of(client.post("/v1/completions", json=body), 400)["code"] == (
        "context_length_exceeded"
    )
    error_of(client.post("/v1/completions", json={"prompt": [65] * (n + 1)}), 400)


def test_empty_token_prompt_is_400(client: TestClient) -> None:
    error_of(client.post("/v1/completions", json={"prompt": []}), 400)


def test_malformed_and_missing_json_are_400(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    err = error_of(client.post("/v1/completions", content=b'{"prompt": ', headers=headers), 400)
    assert err["code"] == "invalid_json" and "JSON" in err["message"]
    nan = b'{"prompt": "x", "temperature": NaN}'
    assert (
        error_of(client.post("/v1/completions", content=nan, headers=headers), 400)["param"]
        == "temperature"
    )
    error_of(client.post("/v1/completions", headers=headers), 400)
    error_of(client.post("/v1/completions", content=b'["prompt"]', headers=headers), 400)
    # curl -d without -H sends a form content type: say what is expected
    form = client.post(
        "/v1/completions",
        content=b'{"prompt": "x"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert "application/json" in error_of(form, 400)["message"]


def test_invalid_chat_bodies_are_400(client: TestClient) -> None:
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ]:
        err = error_of(client.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == param, body


def test_other_errors_are_json(client: TestClient) -> None:
    assert error_of(client.get("/v1/nothing-here"), 404)["code"] == "not_found"
    r = client.get("/v1/completions")
    assert error_of(r, 405)["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]
    assert error_of(client.get("/v1/sessions/bad.id!"), 400)["param"] == "session_id"
    big = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large"


def test_unexpected_errors_are_500_without_details(
    client: TestClient,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom() -> dict[str, Any]:
        raise RuntimeError("secret=hunter2 in a stack frame")

    monkeypatch.setattr(engine, "health", boom)
    r = client.get("/healthz")
    err = error_of(r, 500)
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "hunter2" not in r.text
    assert "hunter2" in caplog.text  # the log has it, for the operator


def test_cache_full_is_503_with_retry_after(
    client: TestClient, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(req: Any) -> Any:
        raise CacheFullError("all 16 KV pages are in use")

    monkeypatch.setattr(engine, "complete", full)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert error_of(r, 503)["code"] == "cache_full"
    assert r.headers["retry-after"] == "1"


def test_concurrent_requests_are_all_answered(client: TestClient) -> None:
    body = dict(prompt="concurrent", max_tokens=6, return_token_ids=True, ignore_eos=True)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: complete(client, **body), range(8)))
    assert len({tuple(r["choices"][0]["token_ids"]) for r in results}) == 1


# -- health, metrics, models, spec ------------------------------------------------------------


def test_healthz(client: TestClient, engine: Engine) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["model"] == engine.model_name
    assert h["worker_id"] == "test-worker" and h["store"] is None


def test_healthz_shows_backend_urls_as_given_without_secrets(tmp_path: Path) -> None:
    # an absolute SQLite path is four slashes; shown with three it would be a relative path
    index = f"sqlite:///{tmp_path / 'index.db'}"
    store = f"file://{tmp_path / 'objects'}?fsync=false"
    eng = Engine(tiny_options(store=store, index=index))
    try:
        h = TestClient(create_app(eng)).get("/healthz").json()
        assert h["index"] == index and h["index"].startswith("sqlite:////")
        assert h["store"] == store
    finally:
        eng.close()


def test_metrics_are_prometheus_text(client: TestClient) -> None:
    complete(client, prompt="count me", max_tokens=1)
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "version=" in r.headers["content-type"]
    m = re.search(r'^kvcloud_worker_requests_total\{status="ok"\} (\S+)$', r.text, re.M)
    assert m and float(m.group(1)) >= 1
    assert "# TYPE kvcloud_worker_ttft_seconds histogram" in r.text


def test_models_list(client: TestClient, engine: Engine) -> None:
    d = client.get("/v1/models").json()
    assert d["object"] == "list" and [m["id"] for m in d["data"]] == [engine.model_name]


def test_openapi_states_bounds_and_400_not_422(client: TestClient, engine: Engine) -> None:
    spec = client.get("/openapi.json").json()
    assert "422" not in json.dumps(spec["paths"])
    assert "400" in spec["paths"]["/v1/completions"]["post"]["responses"]
    body = spec["components"]["schemas"]["CompletionBody"]["properties"]
    max_tokens = next(s for s in body["max_tokens"]["anyOf"] if s.get("type") == "integer")
    assert max_tokens["minimum"] == 1 and max_tokens["maximum"] == engine.max_context
    ids = next(s for s in body["prompt"]["anyOf"] if s.get("type") == "array")
    assert ids["items"]["exclusiveMaximum"] == engine.tokenizer.vocab_size


# -- shutdown ---------------------------------------------------------------------------------


def test_shutdown_flushes_sessions_and_closes_the_engine(tmp_path: Path) -> None:
    store, index = f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
    eng = Engine(tiny_options(store=store, index=index))
    calls: list[str] = []
    real_flush_all, real_close = eng.flush_all, eng.close

    def flush_all() -> list[Any]:
        calls.append("flush_all")
        return real_flush_all()

    def close() -> None:
        calls.append("close")
        real_close()

    eng.flush_all, eng.close = flush_all, close  # type: ignore[method-assign]
    with TestClient(create_app(eng)) as c:
        sid = c.post("/v1/sessions").json()["id"]
        done = complete(c, prompt=LONG_TEXT, max_tokens=4, session_id=sid)
        assert calls == []
    assert calls == ["flush_all", "close"]

    # a fresh worker on the same store finds the flushed history
    other = Engine(tiny_options(store=store, index=index))
    try:
        info = TestClient(create_app(other)).get(f"/v1/sessions/{sid}").json()
        assert info["stored"] is True and info["resident"] is False
        assert info["tokens"] == done["kvcloud"]["session_tokens"]
    finally:
        other.close()


# -- the kvcloud-worker command ---------------------------------------------------------------


def test_cli_config_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for argv in (
        ["serve", "--write-policy", "sometimes"],
        ["serve", "--model", "tiny", "--store", "file:///tmp/x"],  # a store needs an index
        ["serve", "--model", "enormous", "--port", "0"],
        ["serve", "--port", "70000"],
    ):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvcloud-worker serve: error:"), err
        assert "Traceback" not in err
    monkeypatch.setenv("KVCLOUD_CACHE_PAGES", "lots")
    assert cli_main(["serve"]) == 2
    assert "KVCLOUD_CACHE_PAGES" in capsys.readouterr().err


def test_cli_serve_answers_and_sigterm_flushes(tmp_path: Path) -> None:
    store, index = f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
    env = {**os.environ, "KVCLOUD_STORE": store, "KVCLOUD_INDEX": index}
    cmd = [
        sys.executable,
        "-m",
        "workers.cli",
        "serve",
        "--model",
        "tiny",
        "--port",
        "0",
        "--chunk-tokens",
        "16",
        "--worker-id",
        "cli-test",
        "--no-access-log",
    ]
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"ready on (http://\S+)", log_path.read_text())
            url = m.group(1) if m else None
            time.sleep(0.1)
        assert url, log_path.read_text()
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/healthz").json()["worker_id"] == "cli-test"
            sid = http.post("/v1/sessions").json()["id"]
            r = http.post(
                "/v1/completions", json={"prompt": LONG_TEXT, "max_tokens": 4, "session_id": sid}
            )
            assert r.status_code == 200, r.text
            tokens = r.json()["kvcloud"]["session_tokens"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    # uvicorn re-raises the SIGTERM it handled once shutdown is done
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "flushed 1 session(s)" in output, output

    # the worker took its secret from the environment; the record is found with the same one
    eng = Engine(tiny_options(store=store, index=index, secret=os.environ.get("KVCLOUD_SECRET")))
    try:
        info = eng.session_info(sid, eng.options.tenant)
        assert info.stored and info.tokens == tokens and 0 < info.kv_tokens <= tokens
    finally:
        eng.close()


# -- streaming --------------------------------------------------------------------------------


def sse_events(r: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an SSE body, ``[DONE]`` as the string."""
    assert r.headers["content-type"].startswith("text/event-stream"), r.text
    out: list[Any] = []
    for block in r.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_the_whole_answer(client: TestClient, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "Tell me about foxes. ü ✓"}]
    else:
        body["prompt"] = "Tell me about foxes. ü ✓"
    whole = client.post(path, json=body).json()
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == kind and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    # the second run found the first one's prompt pages in the prefix cache
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["kvcloud"]["session_id"] is None and usage["kvcloud"]["ttft_ms"] > 0
    choices = [c["choices"][0] for c in chunks]
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["text"] for c in choices)
        assert text == whole["choices"][0]["text"]
    assert [t for c in choices for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert len(choices) > 3  # tokens went out as they came, not in one piece


def test_stream_failing_before_the_first_token_is_an_ordinary_error(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", json={"prompt": "x", "stream": True, "session_id": UNKNOWN_SESSION}
    )
    assert error_of(r, 404)["code"] == "session_not_found"


def test_error_mid_stream_is_an_error_event(engine: Engine, monkeypatch: Any) -> None:
    real = engine.complete

    def fails_after_two(req: Any) -> Any:
        assert req.on_token is not None
        req.on_token(65)
        req.on_token(66)
        raise CacheFullError("every KV page is in use")

    monkeypatch.setattr(engine, "complete", fails_after_two)
    try:
        c = TestClient(create_app(engine), raise_server_exceptions=False)
        r = c.post("/v1/completions", json={"prompt": "x", "stream": True})
    finally:
        monkeypatch.setattr(engine, "complete", real)
    events = sse_events(r)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["A", "B"]
    assert events[2]["error"]["message"] == "every KV page is in use"
    assert events[2]["error"]["type"] == "server_error"
    assert len(events) == 3  # no [DONE] after an error


def test_a_stream_whose_reader_leaves_ends_the_turn_consistently(engine: Engine) -> None:
    """The engine side of a disconnect: generation stops at the next token, and the session
    holds exactly the prompt and the tokens generated, with their KV (checked by continuing
    it and comparing with a session that never streamed)."""
    from workers.engine import CompletionRequest

    prompt = list(LONG_TEXT.encode())
    got: list[int] = []

    def reader(tok: int) -> bool:
        got.append(tok)
        return len(got) < 5  # gone after the fifth token

    sid = engine.create_session("default")
    res = engine.complete(
        CompletionRequest(prompt, max_tokens=50, session_id=sid, on_token=reader, stop_at_eos=False)
    )
    assert res.tokens == got and len(got) == 5
    info = engine.session_info(sid, "default")
    assert info.tokens == len(prompt) + 5  # the prompt, then the five tokens
    nxt = engine.complete(CompletionRequest(list(b" More."), max_tokens=6, session_id=sid))
    ref = engine.create_session("default")
    engine.complete(CompletionRequest(prompt, max_tokens=5, session_id=ref, stop_at_eos=False))
    want = engine.complete(CompletionRequest(list(b" More."), max_tokens=6, session_id=ref))
    assert nxt.tokens == want.tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_turn_is_in_the_index_before_its_answer_ends(
    tmp_path: Path, stream: bool
) -> None:
    """Write-through: when the client has the whole answer (the JSON body, or the stream's
    ``[DONE]``), the session's record already holds the turn, so a load balancer may send
    the next turn to any worker."""
    store, index = f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
    eng = Engine(tiny_options(store=store, index=index))
    try:
        c = TestClient(create_app(eng))
        sid = c.post("/v1/sessions").json()["id"]
        body = {
            "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": 5,
            "ignore_eos": True,
            "session_id": sid,
            "stream": stream,
        }
        kv = eng.kv
        assert kv is not None
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            want = r.json()["kvcloud"]["session_tokens"]
        else:
            body["stream_options"] = {"include_usage": True}
            want = None
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        want = json.loads(line[6:])["kvcloud"]["session_tokens"]
                    if line == "data: [DONE]":
                        # read while the response is still open: written before [DONE]
                        rec = kv.load_session(eng.ns, sid, eng.options.tenant)
                        assert want is not None and rec.n_tokens == want
                        break
                else:
                    pytest.fail("no [DONE]")
        rec = kv.load_session(eng.ns, sid, eng.options.tenant)
        assert rec.n_tokens == want
        messages = rec.meta["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"]
    finally:
        eng.close()
