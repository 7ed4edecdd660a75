"""``kvcloud estimate``: the KV size of a prefix, from the seed's formula."""

from __future__ import annotations

import argparse
from typing import Any

from ...errors import KVCloudError
from ...models import KV_SHAPES
from ...namespace import DTYPES
from .common import emit_json


def estimate(layers: int, tokens: int, kv_dim: int, bytes_per_element: float) -> dict[str, Any]:
    """The seed's formula: bytes = layers × tokens × kv_dim × bytes_per_element × 2 (K and V)."""
    total = layers * tokens * kv_dim * bytes_per_element * 2
    total_int = int(total)
    return {
        "layers": layers,
        "tokens": tokens,
        "kv_dim": kv_dim,
        "bytes_per_element": bytes_per_element,
        "bytes_per_token": layers * kv_dim * bytes_per_element * 2,
        "bytes": total_int,
        "gib": total_int / 2**30,
        "gb": total_int / 1e9,
    }


def cmd_estimate(args: argparse.Namespace) -> int:
    layers, kv_dim, bpe = args.layers, args.kv_dim, args.bytes_per_element
    if args.model:
        shape = KV_SHAPES.get(args.model)
        if shape is None:
            raise KVCloudError(f"unknown model {args.model!r}; known: {', '.join(KV_SHAPES)}")
        layers = layers or shape.num_layers
        kv_dim = kv_dim or shape.kv_dim
        if bpe is None and args.dtype is None:
            bpe = DTYPES[shape.dtype].itemsize
    if args.dtype:
        if args.dtype not in DTYPES:
            raise KVCloudError(f"unknown dtype {args.dtype!r}; known: {', '.join(DTYPES)}")
        bpe = DTYPES[args.dtype].itemsize
    missing = [
        flag
        for flag, v in (("--layers", layers), ("--kv-dim", kv_dim), ("--bytes-per-element", bpe))
        if not v
    ]
    if missing:
        raise KVCloudError(f"estimate needs {', '.join(missing)} (or --model PRESET)")
    if args.tokens <= 0 or layers <= 0 or kv_dim <= 0 or bpe <= 0:
        raise KVCloudError("all sizes must be positive")
    bpe_value: float = int(bpe) if float(bpe).is_integer() else float(bpe)
    r = estimate(layers, args.tokens, kv_dim, bpe_value)
    if args.model:
        r["model"] = args.model
    if args.json:
        emit_json(r)
        return 0
    print(f"{r['bytes']:,} bytes = {r['gib']:.2f} GiB = {r['gb']:.2f} GB")
    print(
        f"  {layers} layers × {args.tokens:,} tokens × {kv_dim} kv_dim × {bpe_value} B × 2 (K,V);"
        f" {r['bytes_per_token']:,} bytes/token"
    )
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser("estimate", help="KV size of a prefix (the seed's formula)")
    e.add_argument("--layers", type=int)
    e.add_argument("--tokens", type=int, required=True)
    e.add_argument("--kv-dim", type=int, help="kv_heads × head_dim")
    e.add_argument("--bytes-per-element", type=float)
    e.add_argument("--dtype", help="instead of --bytes-per-element: " + ", ".join(DTYPES))
    e.add_argument("--model", help="take the shape from a preset: " + ", ".join(KV_SHAPES))
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)
