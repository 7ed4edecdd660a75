"""A Llama-family decoder (RoPE, grouped-query attention, RMSNorm, SwiGLU) in torch.

The model never owns KV memory: every forward pass writes the new tokens' K and V into the
caller's pages (in the cache dtype) and attends over what the pages hold. Because attention
always reads K/V back from the pages, a page restored from kvcloud is indistinguishable from
one this process computed, which is what makes a moved session bit-identical.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvcloud.models import KV_SHAPES


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_context: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    seed: int = 0
    # What Hugging Face checkpoints add (workers/engine/hf.py); the presets keep the defaults.
    attn_bias: bool = False  # Qwen2: biases on the q/k/v projections
    rope_type: str = "default"  # default | linear | llama3 | yarn
    # the rope_type's parameters (factor, original_max_position_embeddings, ...), sorted
    rope_params: tuple[tuple[str, float], ...] = ()
    # per layer: attend only to the last N keys (Mistral, Qwen2 sliding layers); () = none
    sliding_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.n_layers:
            raise ValueError("sliding_windows needs one entry per layer")

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None


# "dynamic" (NTK) scaling is left out on purpose: it changes every position's rotation once a
# sequence outgrows the original context, so KV computed at one length is wrong at another,
# and stored KV could not be reused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# Byte-level tokenizer: 256 byte ids + BOS + EOS.
BYTE_VOCAB = 258

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        "tiny",
        BYTE_VOCAB,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        max_context=4096,
        tie_embeddings=False,
    ),
    "small": ModelConfig(
        "small",
        BYTE_VOCAB,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        head_dim=64,
        ffn_dim=2048,
        max_context=16384,
        tie_embeddings=False,
    ),
}

# kvcloud sizes KV from its own table; a preset that disagreed would mis-size every estimate.
for _name, _cfg in PRESETS.items():
    _shape = KV_SHAPES[_name]
    assert (_shape.num_layers, _shape.num_kv_heads, _shape.head_dim) == (
        _cfg.n_layers,
        _cfg.n_kv_heads,
        _cfg.head_dim,
    ), _name


def preset(name: str, seed: int = 0) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    return ModelConfig(**{**cfg.__dict__, "seed": seed})


class KVPages(Protocol):
    """Where a forward pass keeps K/V: the engine's page table for one sequence."""

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[n, kv_heads, head_dim]`` for positions ``start .. start+n-1``."""

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions ``0 .. length-1`` as ``[length, kv_heads, head_dim]``."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32 whatever the weights' dtype, as the reference models do
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.rms_eps)
        self.gate_proj = nn.Linear(d, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(d, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, d, bias=False)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64, ``[head_dim/2]``) and the factor cos/sin are scaled by,
    for the RoPE variants Llama, Qwen2 and Mistral checkpoints use (the formulas their
    papers and reference implementations define)."""
    d = cfg.head_dim
    p = dict(cfg.rope_params)
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_type == "default":
        return base, 1.0
    factor = float(p["factor"])
    if cfg.rope_type == "linear":
        return base / factor, 1.0
    if cfg.rope_type == "llama3":
        # Llama 3.1: long wavelengths are interpolated by `factor`, short ones kept, and the
        # band between blends the two.
        old_ctx = float(p["original_max_position_embeddings"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old_ctx / low, base / factor, base)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled), 1.0
    # yarn: per-dimension blend of interpolation and extrapolation, plus an attention factor
    old_ctx = float(p.get("original_max_position_embeddings") or cfg.max_context / factor)
    beta_fast, beta_slow = float(p.get("beta_fast", 32.0)), float(p.get("beta_slow", 1.0))
    if p.get("attention_factor") is not None:
        attention = float(p["attention_factor"])
    elif p.get("mscale") and p.get("mscale_all_dim"):
        attention = _yarn_mscale(factor, float(p["mscale"])) / _yarn_mscale(
            factor, float(p["mscale_all_dim"])
        )
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", 1.0):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # avoids a division by zero in the ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolated = 1 - ramp
    inv = (base / factor) * (1 - extrapolated) + base * extrapolated
    return inv, attention


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv, attention = rope_inv_freq(cfg)
    pos = torch.arange(cfg.max_context, dtype=torch.float64)
    angles = torch.outer(pos, inv)
    cos, sin = angles.cos() * attention, angles.sin() * attention
    return cos.float().to(device), sin.float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; cos/sin: [n, head_dim/2]. Rotate-half convention (Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# Queries are processed in blocks so a long prefill never materialises a full
# [heads, n, context] score matrix at once.
_ATTN_BLOCK = 512


class Decoder(nn.Module):
    """``weights`` (our parameter names, see workers/engine/hf.py) replaces the seeded random init;
    the modules are then built on the meta device, so a large checkpoint is never
    allocated twice."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: str | torch.device = "cpu",
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.device("meta") if weights is not None else contextlib.nullcontext():
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.d_model, cfg.rms_eps)
            self.lm_head = (
                None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            )
        if weights is None:
            self._init_weights()
            self.to(device=device, dtype=dtype)
        else:
            self.to_empty(device=device)
            self.to(dtype=dtype)
            self._load(weights)
        self.eval()
        self.device = torch.device(device)
        self.cos, self.sin = rope_tables(cfg, self.device)

    @torch.no_grad()
    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in as they come (a shard at a time: peak memory is the model plus
        one shard, not two models)."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, w in weights:
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(
                    f"tensor {name}: shape {tuple(w.shape)} in the checkpoint, "
                    f"{tuple(p.shape)} from config.json"
                )
            p.copy_(w.to(p.dtype))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit the model: missing {missing[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Seeded on a private CPU generator: identical weights in every process and on every
        # machine, whatever else touched torch's global RNG.
        g = torch.Generator(device="cpu").manual_seed(self.cfg.seed)
        # Unit-variance embeddings and 1/sqrt(fan_in) projections keep every layer's
        # contribution comparable to the residual stream, so the random model's output
        # depends on the whole context (a model that just echoes its input token would make
        # a broken restore look correct).
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, tokens: torch.Tensor, start: int, kv: KVPages, last_only: bool = True
    ) -> torch.Tensor:
        """Run ``tokens`` (positions start..start+n-1) over the KV of positions < start.

        Returns logits for the last position (``[vocab]``) or all (``[n, vocab]``).
        """
        cfg = self.cfg
        n = tokens.shape[0]
        end = start + n
        if end > cfg.max_context:
            raise ValueError(f"position {end} exceeds the context of {cfg.max_context}")
        x = self.embed(tokens.to(self.device))
        cos, sin = self.cos[start:end], self.sin[start:end]
        group = cfg.n_heads // cfg.n_kv_heads
        scale = 1.0 / math.sqrt(cfg.head_dim)
        for li, layer in enumerate(self.layers):
            window = cfg.window(li)
            h = layer.attn_norm(x)
            q = apply_rope(layer.q_proj(h).view(n, cfg.n_heads, cfg.head_dim), cos, sin)
            k = apply_rope(layer.k_proj(h).view(n, cfg.n_kv_heads, cfg.head_dim), cos, sin)
            v = layer.v_proj(h).view(n, cfg.n_kv_heads, cfg.head_dim)
            kv.write(li, start, k, v)
            keys, values = kv.read(li, end)  # includes the tokens just written
            # [kvh, ctx, hd] views of fp32 copies: batched GEMMs read the strides directly
            k_t = keys.float().transpose(0, 1)
            v_t = values.float().transpose(0, 1)
            # [kvh, group, n, hd]: each KV head serves its query group, no repeat of K/V
            qg = q.view(n, cfg.n_kv_heads, group, cfg.head_dim).permute(1, 2, 0, 3)
            out = torch.empty_like(qg)
            for b0 in range(0, n, _ATTN_BLOCK):
                b1 = min(n, b0 + _ATTN_BLOCK)
                nb = b1 - b0
                ctx = start + b1  # keys this block can see at most
                qb = qg[:, :, b0:b1].reshape(cfg.n_kv_heads, group * nb, cfg.head_dim)
                scores = torch.bmm(qb.float(), k_t[:, :ctx].transpose(1, 2)).mul_(scale)
                # a single (last) query sees every key unless a sliding window hides some
                if nb > 1 or (window is not None and ctx > window):
                    qpos = torch.arange(start + b0, start + b1, device=self.device)
                    kpos = torch.arange(ctx, device=self.device)
                    mask = kpos[None, :] > qpos[:, None]
                    if window is not None:
                        mask |= kpos[None, :] <= qpos[:, None] - window
                    scores = scores.view(cfg.n_kv_heads, group, nb, ctx)
                    scores.masked_fill_(mask, float("-inf"))
                    scores = scores.view(cfg.n_kv_heads, group * nb, ctx)
                probs = torch.softmax(scores, dim=-1)
                out[:, :, b0:b1] = torch.bmm(probs, v_t[:, :ctx]).view(
                    cfg.n_kv_heads, group, nb, cfg.head_dim
                )
            attn = out.permute(2, 0, 1, 3).reshape(n, cfg.n_heads * cfg.head_dim).to(x.dtype)
            x = x + layer.o_proj(attn)
            h = layer.mlp_norm(x)
            x = x + layer.down_proj(torch.nn.functional.silu(layer.gate_proj(h)) * layer.up_proj(h))
        if last_only:
            x = x[-1:]
        x = self.norm(x)
        logits = x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)
        return logits[0] if last_only else logits


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / T) with the request's seed."""
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
