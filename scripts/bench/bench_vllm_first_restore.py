"""A fresh vLLM's first restore, timed as a new user meets it, phase by phase.

A writer vLLM (the connector) prefills ``--prompts`` fresh prompts of ``--tokens`` tokens and
stores them (moto_server + redis-server). Then a fresh vLLM with the connector starts and is
asked for the first prompt (its first request ever, ``max_tokens=1``), then for the others;
a warmed-up vLLM without the connector computes the same prompts. All three serve
``--dtype`` (bfloat16 by default) compiled, as users run it (``--eager`` for eager), and
reserve no core (every server on both cores alike).

Per request of the fresh server: its TTFT; the TTFT of the same prompt asked again, which
vLLM's own prefix cache then serves (no restore, only the tail computed: the floor any
restore could reach, so reference ÷ floor is the most a restore could gain here); the
connector's phases from its counters (lookup,
restore: pull + verify + block writes, of which block writes; the wait for the restore's
report) and vLLM's own (time queued, which holds an asynchronous restore, and prefill), against
the reference's TTFT on the same prompt.

    python scripts/bench/bench_vllm_first_restore.py --out docs/bench/vllm_first_restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.vllm_fleet import (
    VLLMServer,
    cached_tokens,
    connector_namespace,
    kvcloud_transfer_config,
    settled,
    wait_stored,
)

PHASES = (
    "lookup_us",
    "load_us",
    "load_write_us",
    "load_write_cpu_us",
    "load_report_us",
    "loaded_tokens",
)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 48_000) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2441)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from tests.servers import s3_env, start_moto, start_redis

    work = Path(tempfile.mkdtemp(prefix="kvcloud-first-restore-"))
    moto, redis = start_moto(work / "moto"), start_redis(work / "redis")
    os.environ.update(s3_env(moto.endpoint))
    env = {
        **s3_env(moto.endpoint),
        "KVCLOUD_STORE": f"s3://kvcloud/first?endpoint_url={moto.endpoint}&region=us-east-1"
        "&create_bucket=true",
        "KVCLOUD_INDEX": redis.url,
        "KVCLOUD_SECRET": "first-restore-secret",
    }
    args = ["--dtype", a.dtype]
    cfg = kvcloud_transfer_config()
    writer = VLLMServer("W", work / "W.log", transfer=cfg, env=env, args=args, eager=a.eager)
    ref = VLLMServer("R", work / "R.log", args=args, eager=a.eager)
    prompts = [tokens(a.tokens, seed=100 + i) for i in range(a.prompts)]
    rows: list[dict[str, Any]] = []
    fresh = None
    try:
        for s in (writer, ref):
            s.start()
        for s in (writer, ref):
            s.wait_ready(600)
        for i in range(2):  # warm the reference at this length (and the writer)
            ref.complete(tokens(a.tokens, seed=900 + i), max_tokens=1)
        for p in prompts:
            writer.complete(p, max_tokens=1)
        ns = connector_namespace(dtype=a.dtype)
        for p in prompts:
            assert wait_stored(env, p, ns=ns) == a.tokens // 256, "not stored"
        settled([writer], timeout=300)
        writer.stop()  # the fresh server alone beside the reference
        fresh = VLLMServer("F", work / "F.log", transfer=cfg, env=env, args=args, eager=a.eager)
        started = time.monotonic()
        fresh.start().wait_ready(600)
        ready_s = time.monotonic() - started
        for i, p in enumerate(prompts):
            before, vllm_before = fresh.metrics(), fresh.timings()
            got = fresh.complete(p, max_tokens=1)
            after, vllm_after = fresh.metrics(), fresh.timings()
            want = ref.complete(p, max_tokens=1)
            # the same prompt again: vLLM's own prefix cache holds it now, so no restore and
            # no prefill but the tail: the floor any restore of this prompt could reach
            floor = fresh.complete(p, max_tokens=1)
            again = fresh.metrics()
            row: dict[str, Any] = {
                "request": i,
                "ttft_s": got["elapsed_s"],
                "reference_ttft_s": want["elapsed_s"],
                "speedup": want["elapsed_s"] / got["elapsed_s"],
                "floor_ttft_s": floor["elapsed_s"],
                "ceiling": want["elapsed_s"] / floor["elapsed_s"],
                # a restore here means vLLM's own cache did not serve the prompt again
                "floor_loaded_tokens": again.get("loaded_tokens", 0)
                - after.get("loaded_tokens", 0),
                "floor_cached_tokens": cached_tokens(floor),
            }
            row.update({k: after.get(k, 0) - before.get(k, 0) for k in PHASES})
            for k in ("request_queue_time_seconds", "request_prefill_time_seconds"):
                row[k] = vllm_after.get(k + "_sum", 0) - vllm_before.get(k + "_sum", 0)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for s in (writer, ref, fresh):
            if s is not None:
                s.stop()
        redis.stop()
        moto.stop()
    print(f"\nfresh server ready in {ready_s:.0f} s; {a.tokens}-token prompts, {a.dtype}"
          f"{' eager' if a.eager else ' compiled'}\n")  # fmt: skip
    print("| request | TTFT ms | reference ms | × faster | vLLM cache hit ms | × at most | "
          "lookup ms | restore ms | of which writes ms | their CPU ms | report wait ms | "
          "queued ms | prefill ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['request'] + 1} | {1e3 * r['ttft_s']:.0f} | {1e3 * r['reference_ttft_s']:.0f} "
            f"| {r['speedup']:.1f}× | {1e3 * r['floor_ttft_s']:.0f} | {r['ceiling']:.1f}× "
            f"| {r['lookup_us'] / 1e3:.0f} | {r['load_us'] / 1e3:.0f} "
            f"| {r['load_write_us'] / 1e3:.0f} | {r['load_write_cpu_us'] / 1e3:.0f} "
            f"| {r['load_report_us'] / 1e3:.0f} "
            f"| {1e3 * r['request_queue_time_seconds']:.0f} "
            f"| {1e3 * r['request_prefill_time_seconds']:.0f} |"
        )
    if a.out:
        meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                "ready_s": ready_s}  # fmt: skip
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
