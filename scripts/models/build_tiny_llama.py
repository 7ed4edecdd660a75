"""A seeded random tiny Llama with SmolLM2's tokenizer: 4 attention heads over 2 KV heads, so
a vLLM can split it over 2 tensor-parallel ranks (SmolLM2's 9 heads cannot be split), small
enough to start in about a minute. Random weights still give deterministic greedy text, which
is all the tests compare (with and without the connector, at each TP size).

    python scripts/models/build_tiny_llama.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.vllm_fleet import SMOLLM2

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build(out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    return save_with_tokenizer(LlamaForCausalLM(tiny_config()), out)


def tiny_config() -> LlamaConfig:
    """4 layers, 4 attention heads over 2 KV heads of 64, SmolLM2's vocabulary."""
    return LlamaConfig(
        vocab_size=49_152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # wider than transformers' default 0.02, whose random model repeats one token
        # whatever the context: greedy text must depend on every position's KV
        initializer_range=0.1,
    )


def save_with_tokenizer(model: PreTrainedModel, out: Path) -> Path:
    """Save ``model`` in float32 safetensors into ``out`` with SmolLM2's tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (SMOLLM2 / name).exists():
            shutil.copy(SMOLLM2 / name, out / name)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
