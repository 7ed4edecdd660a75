"""``kvcloud size``: what a vLLM fleet using kvcloud needs of S3, Redis and host memory, from
the model's config.json and the fleet's load (:mod:`kvcloud.tools.sizing`)."""

from __future__ import annotations

import argparse
from typing import Any

from ...errors import ConfigError
from ...indexes.base import DEFAULT_TTL_SECONDS
from ...integrations.vllm.config import VLLMConnectorConfig
from ...namespace import DEFAULT_CHUNK_TOKENS
from ..sizing import KV_DTYPES, REDIS_SERVERS, FleetLoad, model_kv, read_config, size_fleet
from .common import emit_json, human_bytes


def cmd_size(args: argparse.Namespace) -> int:
    if (args.rps is None) == (args.rpm is None):
        raise ConfigError("give the load as --rps or --rpm (one of them)")
    # the connector's defaults, and its own checks of any setting given
    settings = {
        name: value
        for name in ("upload_queue", "staging_mib", "max_connections")
        if (value := getattr(args, name)) is not None
    }
    connector = VLLMConnectorConfig(**settings)
    load = FleetLoad(
        requests_per_s=args.rps if args.rps is not None else args.rpm / 60.0,
        prompt_tokens=args.prompt_tokens,
        hit_rate=args.hit_rate,
        saved_tokens=args.saved_tokens,
        answer_tokens=args.answer_tokens,
        tp=args.tp,
        pods=args.pods,
        kv_dtype=args.kv_dtype,
        chunk_tokens=args.chunk_tokens,
        head_parts=args.head_parts,
        ttl_seconds=args.ttl,
        conditional_put=args.conditional_put == "honoured",
        redis=args.redis,
        connector=connector,
    )
    result = size_fleet(model_kv(read_config(args.config), args.dtype), load)
    result["config"] = str(args.config)
    if args.json:
        emit_json(result)
    else:
        print_table(result)
    return 0


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB/s"


def _row(label: str, fleet: str, pod: str = "", note: str = "") -> None:
    print(f"  {label:<30} {fleet:>20} {pod:>16}  {note}".rstrip())


def print_table(r: dict[str, Any]) -> None:
    m, ld, kv, ob = r["model"], r["load"], r["kv"], r["objects"]
    s3, rd, hm = r["s3"], r["redis"], r["host_memory"]
    if m["mla"]:  # stored as one head of half the latent row; shown as the row
        shape = f"an MLA latent row of {m['mla'][0]} + {m['mla'][1]}"
    else:
        shape = f"{m['num_kv_heads']} KV heads × {m['head_dim']}"
    print(
        f"{m['model_type']}: {m['num_layers']} layers × {shape}, {m['kv_dtype']} KV "
        f"(model {m['dtype']})"
    )
    for note in m["notes"]:
        print(f"  note: {note}")
    print(
        f"load: {ld['requests_per_s']:,.2f} requests/s × {ld['prompt_tokens']:,} prompt tokens, "
        f"{ld['hit_rate']:.0%} restored ({ld['restored_tokens']:,.0f} tokens), "
        f"{ld['saved_tokens']:,.0f} saved per request; TP {ld['tp']}, {ld['pods']} pods, "
        f"{ld['chunk_tokens']}-token chunks"
    )
    print()
    _row("KV bytes per token", f"{kv['bytes_per_token']:,}", "", human_bytes(kv["bytes_per_token"]))
    _row("KV bytes per chunk", f"{kv['chunk_bytes']:,}", "", human_bytes(kv["chunk_bytes"]))
    each = " or ".join(f"{s:,}" for s in sorted(set(ob["bytes"])))  # (equal head ranges)
    header = f"{ob['overhead'] // ob['per_chunk']:,} B of header each"
    _row("objects per chunk", f"{ob['per_chunk']} × {each} B", "", header)
    _row("GETs per restored chunk", f"{ob['gets_per_restored_chunk']}", "", "all ranks")
    print()
    _row("S3", "fleet", "per pod")
    _row("PUT/s", f"{s3['put']['fleet']:,.1f}", f"{s3['put']['per_pod']:,.1f}")
    _row("GET/s", f"{s3['get']['fleet']:,.1f}", f"{s3['get']['per_pod']:,.1f}")
    head_note = "If-None-Match honoured" if s3["conditional_put"] else "HEAD before each PUT"
    _row("HEAD/s", f"{s3['head']['fleet']:,.1f}", f"{s3['head']['per_pod']:,.1f}", head_note)
    _row("upload (PUT bytes)", _gb(s3["put"]["bytes"]), _gb(s3["put"]["bytes_per_pod"]))
    _row("download (GET bytes)", _gb(s3["get"]["bytes"]), _gb(s3["get"]["bytes_per_pod"]))
    print()
    days = ld["ttl_seconds"] / 86400
    _row(
        f"Redis ({rd['server']})",
        f"{rd['bytes_per_chunk']:,.0f} B/chunk",
        "",
        f"{rd['entries_per_chunk']} index entr{'y' if rd['entries_per_chunk'] == 1 else 'ies'}"
        " per chunk",
    )
    _row("per million chunks", human_bytes(rd["bytes_per_million_chunks"]))
    _row(f"chunks over the TTL ({days:g} d)", f"{rd['chunks_in_ttl']:,.0f}", "", "at least")
    _row("Redis memory over the TTL", human_bytes(rd["bytes_in_ttl"]))
    _row("store bytes over the TTL", human_bytes(r["store"]["bytes_in_ttl"]))
    print()
    _row("host memory per vLLM rank", "", "", f"upload queue {hm['upload_queue']}, "
         f"staging {hm['staging_mib']} MiB")  # fmt: skip
    for rank in _distinct_ranks(hm["ranks"]):
        label = f"rank {rank['rank']}" + ("" if rank["writes"] else " (reads only)")
        _row(
            label,
            human_bytes(rank["total"]),
            "",
            f"upload {human_bytes(rank['upload_buffers'])} + PUT bodies "
            f"{human_bytes(rank['put_bodies'])} + staging {human_bytes(rank['staging'])}",
        )
    _row("host memory per pod", human_bytes(hm["per_pod"]))


def _distinct_ranks(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first rank of each kind (ranks alike in every figure are shown once)."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for rank in ranks:
        kind = tuple(v for k, v in sorted(rank.items()) if k != "rank")
        if kind not in seen:
            seen.add(kind)
            out.append(rank)
    return out


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "size", help="S3, Redis and host memory for a vLLM fleet using kvcloud, from config.json"
    )
    s.add_argument("--config", required=True, help="the model's config.json, or its directory")
    s.add_argument("--rps", type=float, help="requests per second, the whole fleet")
    s.add_argument("--rpm", type=float, help="instead of --rps: requests per minute")
    s.add_argument("--prompt-tokens", type=int, required=True, help="prompt tokens per request")
    s.add_argument(
        "--hit-rate", type=float, default=0.0, help="share of prompt tokens restored (0 to 1)"
    )
    s.add_argument(
        "--saved-tokens",
        type=float,
        help="new tokens saved per request (default: prompt tokens not restored + --answer-tokens)",
    )
    s.add_argument(
        "--answer-tokens", type=int, default=0, help="answer tokens per request, saved too"
    )
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each server")
    s.add_argument("--pods", type=int, default=1, help="vLLM servers (TP groups) in the fleet")
    s.add_argument("--dtype", help="vLLM's --dtype (default: the config's; float32 → bfloat16)")
    s.add_argument(
        "--kv-dtype", default="auto", help="vLLM's --kv-cache-dtype: " + ", ".join(KV_DTYPES)
    )
    s.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    s.add_argument("--head-parts", type=int, default=1, help="KVCLOUD_HEAD_PARTS")
    s.add_argument(
        "--ttl", type=int, default=DEFAULT_TTL_SECONDS, help="index TTL, seconds (7 days)"
    )
    s.add_argument("--upload-queue", type=int, help="KVCLOUD_UPLOAD_QUEUE (64)")
    s.add_argument("--staging-mib", type=int, help="KVCLOUD_STAGING_MIB (512)")
    s.add_argument("--max-connections", type=int, help="KVCLOUD_MAX_CONNECTIONS (16)")
    s.add_argument(
        "--conditional-put",
        choices=("honoured", "head"),
        default="honoured",
        help="the S3 server honours If-None-Match (AWS, MinIO, Ceph), or kvcloud HEADs first",
    )
    s.add_argument("--redis", choices=tuple(REDIS_SERVERS), default="redis8")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_size)
