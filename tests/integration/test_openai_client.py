"""The official ``openai`` Python client against real ``kvcloud-worker serve`` processes:
models, completions and chat, sync and async, streaming and not, sessions moving between two
workers, and the errors a client sees (``BadRequestError``, ``NotFoundError``,
``AuthenticationError``) — what every OpenAI-compatible application will do to a worker."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.servers import WorkerProcess, free_port  # noqa: E402

KEY = "sk-kvcloud-test-0123456789abcdef"
OTHER_KEY = "sk-kvcloud-other-0123456789abcdef"
GEN = {"max_tokens": 12, "temperature": 0}
NO_EOS = {"ignore_eos": True}  # the tiny preset's random weights may say EOS at once


class Fleet:
    def __init__(self, tmp: Path) -> None:
        env = dict(os.environ)
        env["KVCLOUD_API_KEYS"] = f"{KEY}=acme,{OTHER_KEY}=globex"
        env["KVCLOUD_SECRET"] = "openai-client-test"
        store, index = f"file://{tmp / 'objects'}", f"sqlite:///{tmp / 'index.db'}"
        self.workers = []
        for name in ("a", "b"):
            port = free_port()
            argv = [sys.executable, "-m", "workers.cli", "serve", "--port", str(port)]
            argv += ["--model", "tiny", "--chunk-tokens", "16", "--cache-pages", "256"]
            argv += ["--store", store]
            argv += ["--index", index]
            url = f"http://127.0.0.1:{port}"
            self.workers.append(WorkerProcess(name, argv, env, tmp / f"{name}.log", port, url))
        for w in self.workers:
            w.start(timeout=120)
        self.urls = [f"http://127.0.0.1:{w.port}" for w in self.workers]

    def client(self, i: int = 0, key: str = KEY) -> Any:
        return openai.OpenAI(base_url=self.urls[i] + "/v1", api_key=key, max_retries=0)

    def new_session(self, i: int = 0) -> str:
        r = httpx.post(self.urls[i] + "/v1/sessions", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def flush(self, sid: str, i: int = 0) -> None:
        r = httpx.post(
            f"{self.urls[i]}/v1/sessions/{sid}/flush", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 200, r.text

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("openai"))
    yield f
    f.stop()


def test_models_list(fleet: Fleet) -> None:
    models = fleet.client().models.list()
    health = httpx.get(fleet.urls[0] + "/healthz").json()
    assert [m.id for m in models.data] == [health["model"]]
    assert models.data[0].object == "model" and models.data[0].owned_by == "kvcloud"


def test_completions_streamed_equal_whole(fleet: Fleet) -> None:
    c = fleet.client()
    whole = c.completions.create(
        model="tiny", prompt="The quick brown fox", **GEN, extra_body=NO_EOS
    )
    text = whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    parts, usage = [], None
    stream = c.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        stream=True,
        stream_options={"include_usage": True},
        **GEN,
        extra_body=NO_EOS,
    )
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        else:
            usage = chunk.usage
    assert "".join(parts) == text
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens


def test_chat_streamed_equal_whole_sync_and_async(fleet: Fleet) -> None:
    messages = [{"role": "user", "content": "Hello, world! How are you today?"}]
    whole = fleet.client().chat.completions.create(
        model="tiny", messages=messages, **GEN, extra_body=NO_EOS
    )
    content = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and content is not None

    sync_parts = [
        ch.choices[0].delta.content or ""
        for ch in fleet.client().chat.completions.create(
            model="tiny", messages=messages, stream=True, **GEN, extra_body=NO_EOS
        )
    ]
    assert "".join(sync_parts) == content

    async def run() -> tuple[str, str, str | None]:
        ac = openai.AsyncOpenAI(base_url=fleet.urls[1] + "/v1", api_key=KEY, max_retries=0)
        try:
            plain = await ac.chat.completions.create(
                model="tiny", messages=messages, **GEN, extra_body=NO_EOS
            )
            parts, finish = [], None
            stream = await ac.chat.completions.create(
                model="tiny", messages=messages, stream=True, **GEN, extra_body=NO_EOS
            )
            async for ch in stream:
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                    finish = ch.choices[0].finish_reason or finish
            return plain.choices[0].message.content or "", "".join(parts), finish
        finally:
            await ac.close()

    plain, streamed, finish = asyncio.run(run())
    # worker B has the same preset and seed: the same answer
    assert plain == streamed == content and finish == "length"


def test_chat_session_moves_between_workers(fleet: Fleet) -> None:
    """Turn 1 on A, flush, turn 2 streamed on B with only the new message: the same answer as
    the stateless conversation, and B restored the history from the store."""
    sid = fleet.new_session(0)
    first = {"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 2}
    a = fleet.client(0).chat.completions.create(
        model="tiny", messages=[first], **GEN, extra_body={**NO_EOS, "session_id": sid}
    )
    reply = a.choices[0].message.content or ""
    fleet.flush(sid, 0)
    second = {"role": "user", "content": "And then?"}
    parts, last = [], None
    for ch in fleet.client(1).chat.completions.create(
        model="tiny",
        messages=[second],
        stream=True,
        stream_options={"include_usage": True},
        **GEN,
        extra_body={**NO_EOS, "session_id": sid},
    ):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        else:
            last = ch
    stateless = fleet.client(1).chat.completions.create(
        model="tiny",
        messages=[first, {"role": "assistant", "content": reply}, second],
        **GEN,
        extra_body=NO_EOS,
    )
    assert "".join(parts) == stateless.choices[0].message.content
    assert last is not None and last.usage is not None
    assert last.usage.prompt_tokens == stateless.usage.prompt_tokens
    stats = (last.model_extra or {})["kvcloud"]
    assert stats["session_id"] == sid and stats["tokens_remote"] > 0


def test_errors_are_the_clients_typed_exceptions(fleet: Fleet) -> None:
    c = fleet.client()
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"session_id": "sess_" + "0" * 32},
        )
    with pytest.raises(openai.NotFoundError):  # a stream that cannot start: the status, too
        c.completions.create(
            model="tiny", prompt="x", stream=True, extra_body={"session_id": "sess_" + "1" * 32}
        )
    with pytest.raises(openai.AuthenticationError):
        fleet.client(key="sk-not-a-key-of-this-worker-000").models.list()
    # another tenant's session is not found, not forbidden: its existence is not disclosed
    sid = fleet.new_session(0)
    with pytest.raises(openai.NotFoundError):
        fleet.client(0, OTHER_KEY).completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"session_id": sid}
        )


def test_a_client_leaving_mid_stream_leaves_a_consistent_session(fleet: Fleet) -> None:
    """Disconnect after a few chunks of a long generation: it stops early, and the session
    holds the prompt and exactly the tokens generated (history and KV agree): continuing it
    equals a stateless run over that history."""
    auth = {"Authorization": f"Bearer {KEY}"}
    url = fleet.urls[0]
    sid = fleet.new_session(0)
    prompt = "The quick brown fox jumps over the lazy dog. "
    body = {"prompt": prompt, "max_tokens": 3000, "stream": True, "session_id": sid}
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, **NO_EOS}, headers=auth, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines == 5:
                break  # and leave: the connection closes here
    prompt_ids = 1 + len(prompt.encode())  # BOS, then the bytes
    # the session's requests wait for the engine, which ends the turn at the next token
    info = httpx.get(f"{url}/v1/sessions/{sid}", headers=auth).json()
    generated = info["tokens"] - prompt_ids
    assert 5 <= generated < 3000, info  # stopped early, after what was sent
    nxt = httpx.post(
        url + "/v1/completions",
        json={"prompt": [65], "max_tokens": 2, "session_id": sid, "return_token_ids": True},
        headers=auth,
    )
    assert nxt.status_code == 200, nxt.text
    # the same history computed without a session: the prompt, the same greedy tokens
    ref = fleet.client(1).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=generated,
        temperature=0,
        extra_body={**NO_EOS, "return_token_ids": True},
    )
    history = [256, *prompt.encode(), *(ref.choices[0].model_extra or {})["token_ids"]]
    assert len(history) == info["tokens"]
    whole = httpx.post(
        fleet.urls[1] + "/v1/completions",
        json={"prompt": [*history, 65], "max_tokens": 2, "return_token_ids": True},
        headers=auth,
    ).json()
    assert nxt.json()["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
