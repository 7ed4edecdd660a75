"""Byte-level tokenizer for the presets, and the chat template.

Token ids 0..255 are the UTF-8 bytes of the text; 256 is BOS and 257 is EOS.

Chat template (one turn per message, then the assistant's cue)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the engine and the HTTP API need from a tokenizer (presets: ByteTokenizer;
    Hugging Face checkpoints: workers.engine.hf.HFTokenizer)."""

    vocab_size: int
    bos_id: int | None  # prepended to a new sequence's text prompt; None: the model has none
    eos_ids: frozenset[int]  # generation stops at any of these (unless ignore_eos)
    chat_adds_bos: bool  # True: the engine adds BOS to a chat prompt; False: the template does

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


class ByteTokenizer:
    bos_id: int | None = 256
    eos_id = 257
    eos_ids: frozenset[int] = frozenset({257})
    vocab_size = 258
    chat_adds_bos = True

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return apply_chat_template(messages, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # BOS/EOS carry no text; invalid UTF-8 (a cut multi-byte char) is replaced, not raised
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


CHAT_ROLES = ("system", "user", "assistant")


def apply_chat_template(
    messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
) -> str:
    parts = []
    for m in messages:
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown chat role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        parts.append(f"<|{role}|>\n{m.get('content', '')}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
