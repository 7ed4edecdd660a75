"""TTFT of a restore on an idle vLLM, ``load_mode=async`` against ``load_mode=sync``.

A pusher vLLM prefills fresh prompts; two receivers (one per mode, same store) restore each
prompt with ``max_tokens=1``, alternating which goes first; TTFT is the request's wall time.
Each receiver answers a 4-token request first (an engine idle for seconds answers late).

    python scripts/bench/bench_vllm_load_modes.py --lengths 1024 2048 --runs 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_vllm import prompt, start
from scripts.fleet.vllm_fleet import (
    ROOT,
    VLLMServer,
    cached_tokens,
    kvcloud_transfer_config,
    wait_stored,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcloud-modes-"))
    env = {
        "KVCLOUD_STORE": f"file://{work / 'objects'}",
        "KVCLOUD_INDEX": f"sqlite://{work / 'index.db'}",
        "KVCLOUD_SECRET": "bench-modes",
    }
    logs = ROOT / ".cache" / "bench-modes-logs"
    pusher = VLLMServer("pusher", logs / "pusher.log", transfer=kvcloud_transfer_config(), env=env)
    modes = {
        mode: VLLMServer(
            mode,
            logs / f"{mode}.log",
            transfer=kvcloud_transfer_config(load_mode=mode, write_policy="off"),
            env=env,
        )
        for mode in ("async", "sync")
    }
    start(pusher, *modes.values())
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for n in args.lengths:
            for run in range(args.runs):
                tokens = prompt(n, seed=1000 * n + run)
                pusher.complete(tokens, max_tokens=1)
                wait_stored(env, tokens)
                order = list(modes) if run % 2 == 0 else list(reversed(modes))
                for mode in order:
                    server = modes[mode]
                    server.complete([7, 8, 9], max_tokens=4)
                    r = server.complete(tokens, max_tokens=1)
                    assert cached_tokens(r) >= n - 256, f"{mode}: no restore"
                    times.setdefault((mode, n), []).append(r["elapsed_s"])
    finally:
        for s in (pusher, *modes.values()):
            s.stop()
    print("| prompt tokens | async TTFT (median) | sync TTFT (median) | async ÷ sync |")
    print("|---:|---:|---:|---:|")
    for n in args.lengths:
        a = statistics.median(times[("async", n)]) * 1e3
        s = statistics.median(times[("sync", n)]) * 1e3
        print(f"| {n:,} | {a:.0f} ms | {s:.0f} ms | {a / s:.2f} |")


if __name__ == "__main__":
    main()
