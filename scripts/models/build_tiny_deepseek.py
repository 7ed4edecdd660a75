"""A seeded random tiny DeepSeek-V2 with SmolLM2's tokenizer: multi-head latent attention
(MLA), so vLLM runs it on its MLA attention backend, whose KV cache is one compressed latent
per token (kv_lora_rank + qk_rope_head_dim = 576 wide, no head axis) rather than per-head K and V.
That is the cache layout the connector must also store and restore; this model lets the tests
exercise it on a CPU in about a minute. Every layer is dense (no mixture of experts) to keep
it small. Random weights still give deterministic greedy text, which is all the tests compare.

    python scripts/models/build_tiny_deepseek.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.models.build_tiny_llama import save_with_tokenizer

NUM_LAYERS = 2


def build(out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=49_152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # MLA: queries straight from the hidden state (no q LoRA), keys and values through a
        # 512-wide latent plus a 64-wide shared rotary key, which is what the cache holds.
        # These two are DeepSeek's own sizes and cannot shrink: vLLM's MLA metadata accepts
        # only latent + rope widths of 320, 512 or 576, and its CPU decode kernel only 576
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        # every layer dense: the experts would only add weight and start-up time
        first_k_dense_replace=NUM_LAYERS,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        # wider than transformers' default 0.02, whose random model repeats one token
        # whatever the context: greedy text must depend on every position's KV
        initializer_range=0.1,
    )
    return save_with_tokenizer(DeepseekV2ForCausalLM(cfg), out)


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
