"""KV geometry of known model shapes, for sizing (``kvcloud estimate --model``).

Only what decides KV size lives here; the worker owns the full model presets and checks
that its ``tiny``/``small`` agree with these rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    @property
    def kv_dim(self) -> int:
        """kv_heads × head_dim: e.g. ``512`` for 4 KV heads of 128."""
        return self.num_kv_heads * self.head_dim


KV_SHAPES: dict[str, KVShape] = {
    s.name: s
    for s in (
        KVShape("tiny", 2, 2, 16),
        KVShape("small", 12, 4, 64),
        KVShape("llama-3-8b", 32, 8, 128, "bfloat16"),
        KVShape("llama-3-70b", 80, 8, 128, "bfloat16"),
        KVShape("qwen2.5-7b", 28, 4, 128, "bfloat16"),
        KVShape("mistral-7b", 32, 8, 128, "bfloat16"),
    )
}
