"""``stream: true``: a completion as Server-Sent Events in OpenAI's chunk format.

The engine runs on a worker thread and hands each token over as it is sampled; the response
is an async generator that turns tokens into text as soon as they decode to whole characters
and writes ``data: {...}`` events, then (with ``stream_options.include_usage``) a last chunk
with the usage and kvcloud's stats, then ``data: [DONE]``.

Failures: one before the first token (a bad request, an unknown session, a full cache) is an
ordinary HTTP error with its status, since no event has been sent yet; one after it is an
``error`` event, as OpenAI sends, and the stream ends. A client that disconnects stops the
generation at the next token; the engine then ends the turn there, so a session holds
exactly what was generated up to that point (tokens and KV together), never half a token.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from ..engine import CompletionRequest, CompletionResult
from ..engine.tokenizer import Tokenizer
from ..errors import WorkerError

log = logging.getLogger("kvcloud.worker.http")


class _Handoff:
    """Tokens from the engine's thread to the response's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.listening = True

    def put(self, kind: str, value: Any) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is going away
            return False
        return True

    def on_token(self, token: int) -> bool:  # engine thread
        return self.listening and self.put("token", token)


class _Detokenizer:
    """Text for a growing list of tokens, released only as whole characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        # a token may end inside a multi-byte character: wait for the rest of it
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def finish(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens)
        common = 0
        while common < min(len(text), len(self.sent)) and text[common] == self.sent[common]:
            common += 1
        rest, self.sent = text[max(common, len(self.sent)) :], text
        return rest


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _error_payload(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, WorkerError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}
    return {
        "error": {
            "message": "internal error; see the worker's log",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }


async def stream_completion(
    run: Callable[[CompletionRequest], CompletionResult],
    req: CompletionRequest,
    tokenizer: Tokenizer,
    *,
    chat: bool,
    model: str,
    include_usage: bool,
    return_token_ids: bool,
    usage: Callable[[CompletionResult], dict[str, Any]],
) -> StreamingResponse:
    """Start ``run(req)`` on a thread and answer with its tokens as SSE; raises (for the
    ordinary error response) if it fails before the first token."""
    loop = asyncio.get_running_loop()
    hand = _Handoff(loop)
    req.on_token = hand.on_token
    ctx = contextvars.copy_context()  # the request id reaches the engine's log records

    def work() -> None:
        try:
            hand.put("done", run(req))
        except BaseException as exc:  # every failure goes to the stream
            hand.put("failed", exc)

    loop.run_in_executor(None, ctx.run, work)
    first = await hand.queue.get()
    if first[0] == "failed":
        hand.listening = False
        raise first[1]

    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, tokens: list[int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if return_token_ids:
            choice["token_ids"] = tokens
        out = {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    async def events() -> AsyncIterator[str]:
        detok = _Detokenizer(tokenizer)
        pending: list[int] = []  # tokens not yet sent (their text is incomplete)
        item = first
        try:
            if chat:
                head = chunk(None, None, [])
                head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(head)
            while True:
                kind, value = item
                if kind == "token":
                    pending.append(value)
                    text = detok.push(value)
                    if text:
                        yield _sse(chunk(text, None, pending))
                        pending = []
                elif kind == "done":
                    res: CompletionResult = value
                    # the result holds every token; the last ones did not pass on_token
                    sent = len(detok.ids)
                    pending += res.tokens[sent:]
                    rest = detok.finish(res.tokens)
                    if rest or pending:
                        yield _sse(chunk(rest, None, pending))
                    yield _sse(chunk(None, res.finish_reason, []))
                    if include_usage:
                        last = {"id": cid, "object": obj, "created": created, "model": model}
                        last["choices"] = []
                        last.update(usage(res))
                        yield _sse(last)
                    yield "data: [DONE]\n\n"
                    return
                else:  # failed after the first token: OpenAI's error event, then the end
                    log.warning("stream %s failed: %s", cid, value)
                    yield _sse(_error_payload(value))
                    return
                item = await hand.queue.get()
        finally:
            # the client went away (or the stream ended): generation stops at the next token
            hand.listening = False

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
