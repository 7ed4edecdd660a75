"""A seeded random tiny Llama whose layers alternate sliding-window and full attention
(``layer_types``, as Gemma 2/3, gpt-oss and Mistral-style hybrids do), with SmolLM2's
tokenizer: with vLLM's hybrid KV cache allocator on it has two KV cache groups, and the
sliding group's blocks behind the window are handed back to vLLM's null block. Random
weights still give deterministic greedy text, which is what the tests compare (with and
without the connector).

    python scripts/models/build_tiny_sliding.py OUT_DIR [--window TOKENS]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.models.build_tiny_llama import save_with_tokenizer, tiny_config

# longer than a chunk (256 tokens) plus a block: a chunk completed while decoding still has
# all its blocks in the window when its step copies it (shorter windows lose those saves)
WINDOW = 320


def build(out: Path, window: int = WINDOW, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    # scripts/models/build_tiny_llama.py's model, its layers then made to alternate
    cfg = tiny_config()
    # vLLM's Llama reads both (model_executor/models/llama.py): even layers slide
    cfg.layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(cfg.num_hidden_layers)
    ]
    cfg.sliding_window = window
    return save_with_tokenizer(LlamaForCausalLM(cfg), out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--window", type=int, default=WINDOW)
    a = p.parse_args()
    print(build(a.out, a.window))
