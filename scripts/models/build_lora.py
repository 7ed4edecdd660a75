"""A small LoRA adapter for SmolLM2, made at install time for the vLLM adapter tests.

peft with a seeded random initialisation (``init_lora_weights=False``: both A and B random, so
the adapter really changes the model's answers; peft's default B = 0 would be a no-op), rank
8 on the attention and MLP projections, saved as a PEFT checkpoint vLLM's ``--lora-modules``
loads. Deterministic: the same seed gives the same bytes, so the adapter digest (which keys
its KV in kvcloud) is stable across machines.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def build(base: Path, out: Path, seed: int, rank: int, scale: float) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)  # large enough to change greedy answers, small enough to stay fluent
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out), safe_serialization=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scale", type=float, default=1.0)
    a = p.parse_args()
    build(a.base, a.out, a.seed, a.rank, a.scale)
    print(f"built {a.out}")


if __name__ == "__main__":
    main()
