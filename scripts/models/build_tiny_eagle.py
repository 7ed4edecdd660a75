"""An EAGLE draft head for SmolLM2, made at install time for the speculative-decoding tests.

EAGLE's draft model is one Llama decoder layer on top of ``fc([embedding of token t+1 ‖
target hidden state at t])`` (vLLM's ``EagleLlamaForCausalLM``, ``llama_eagle.py``), sharing
the target's embeddings and LM head. A trained head is not installable here, so this one is
built from SmolLM2 itself, deterministically: ``fc`` passes the next token's embedding
through, whitened (its hidden-state half small and seeded random), and the decoder layer
is a copy of SmolLM2's first layer with its outputs scaled down (``OUT_SCALE``). Its
proposals are then mostly "the same token again", right often enough on a small model's
repetitive answers for vLLM's acceptance counters to move (about a third of them), and its
attention reads the draft layer's KV over the whole context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# EAGLE's output goes to the target's (tied) LM head without a final norm: a head whose
# output stays near the whitened embedding of the token it is given proposes that token
# again, right on the repetitive answers a small model gives; its attention, over the draft
# layer's KV, still shifts the proposals.
OUT_SCALE = 0.1


def build(base: Path, out: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    config = json.loads((base / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(base.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    hidden = int(config["hidden_size"])
    g = torch.Generator().manual_seed(seed)
    # the embedding half whitens the token's embedding (E^T E)^-1 e_t, rescaled to the
    # embeddings' norm: against the tied LM head E its top logit is token t itself (for
    # every token: checked on SmolLM2's vocabulary), where e_t alone tops 9 % of them
    emb = weights["model.embed_tokens.weight"].double()
    white = torch.linalg.inv(emb.T @ emb)
    white *= emb.norm(dim=1).mean() / (emb @ white).norm(dim=1).mean()
    fc = torch.cat(
        [white.float(), 0.01 * torch.randn(hidden, hidden, generator=g)], dim=1
    )  # [hidden, 2 × hidden]: fc(x) = x @ fc.T
    head = {"fc.weight": fc.contiguous()}
    for name, tensor in weights.items():
        # (EAGLE's first layer has no input norm: fc's output goes straight in)
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            t = tensor.float()
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = OUT_SCALE * t  # the layer's additions small beside the token's embedding
            head[name.removeprefix("model.")] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(head, str(out / "model.safetensors"))
    eagle = {
        **config,
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "dtype": "float32",
    }
    eagle.pop("_model_name_or_path", None)
    (out / "config.json").write_text(json.dumps(eagle, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build(a.base, a.out, a.seed)
    print(f"built {a.out}")


if __name__ == "__main__":
    main()
