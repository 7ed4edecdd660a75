"""Byte-level tokenizer for the presets, and the chat template.

Token ids 0..255 are the UTF-8 bytes of the text; 256 is BOS and 257 is EOS.

Chat template (one turn per message, then the assistant's cue)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class ByteTokenizer:
    bos_id = 256
    eos_id = 257
    vocab_size = 258

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
