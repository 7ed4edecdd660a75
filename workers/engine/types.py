"""Request and result types shared by the engine, the HTTP server and the CLI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class CompletionRequest:
    prompt_tokens: list[int]  # new tokens; for a session they are appended to its history
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    session_id: str | None = None
    tenant: str = "default"
    stop_at_eos: bool = True
    add_bos: bool = False  # prepend BOS when the model input would otherwise start empty
    # a chat turn of a session: the new messages. The model input is then the chat template
    # rendered over the session's whole conversation plus these (prompt_tokens unused), and
    # the session's KV is reused up to the longest common token prefix
    messages: list[dict[str, str]] | None = None
    # streaming: called (on the engine's thread) with each generated token as it is sampled;
    # returning False stops generation there (the client went away). What was generated up
    # to that point is a complete turn: it is in the session, KV and history alike.
    on_token: Callable[[int], bool] | None = field(default=None, repr=False, compare=False)


@dataclass
class CompletionResult:
    tokens: list[int]  # generated token ids
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int  # tokens of model input: session history + new prompt
    tokens_local: int  # prompt tokens whose KV was already in this worker's pages
    tokens_remote: int  # prompt tokens whose KV was pulled from kvcloud
    tokens_computed: int  # prompt tokens prefilled by the model
    session_tokens: int  # session history length after this turn (0 without a session)
    ttft_ms: float
    total_ms: float
    session_id: str | None = None


@dataclass
class FlushResult:
    session_id: str
    tokens: int  # history length
    kv_tokens: int  # tokens whose KV is now stored
    chunks_pushed: int  # full chunks newly stored by this flush
    bytes_pushed: int
    stored: bool  # False when the worker has no store (nothing could be pushed)


@dataclass
class SessionInfo:
    session_id: str
    tokens: int
    kv_tokens: int
    resident: bool  # held in this worker's pages
    stored: bool  # a record exists in the index
    updated: float | None = None
    extra: dict[str, object] = field(default_factory=dict)
