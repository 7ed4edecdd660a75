"""Never slower than recompute: TTFT of a vLLM with the cost guard, one without it, and a vLLM
without any connector, on the same requests, from a fast store and from one throttled to a
bandwidth where restoring loses.

Three vLLM servers (SmolLM2, fp32 eager, as the tests run them): ``guard`` (the connector,
default ``cost_margin``), ``no guard`` (the connector, ``KVCLOUD_COST_MARGIN=0``: every hit
loaded, as before the guard) and ``plain`` (no connector: the reference). The store is
moto_server behind a fault proxy (scripts/fleet/fault_proxy.py), the index redis-server. Every
prompt (``--tokens`` tokens, fresh) is stored first; then each phase asks each server for
the same prompts one by one (``max_tokens=1``; vLLM's own prefix cache reset before each
request, so a hit can only come from kvcloud):

- ``fast``: the proxy forwards at full speed: restoring wins;
- ``miss``: prompts never stored, store fast: the connector's own cost on a request it
  computes (the lookup, the copies of the chunks it saves in that step), the floor of what
  the guard can reach when it computes;
- ``throttled``: the proxy delivers the store's answers at ``--throttle-mbps`` MB/s:
  restoring loses. The guarded server's first request still loads (its restore rate says
  the store is fast), runs into its timeout (``load_timeout``; 200 ms for a restore
  ``load_mode=auto`` put in the step) and measures what the store delivered; the ones after
  are computed. The unguarded server pays that timeout on each request until its store
  breaker opens.

Each request is timed alone: the connector servers' uploads (write-through) are waited for
before the next request (on 2 cores any runnable thread slows vLLM's OpenMP prefill).

Prints per phase the median TTFT of each server, the ratio of medians to ``plain``'s, the
median of the per-prompt ratios (each server's TTFT over plain's on the same prompt, which
the prompts' own spread does not move) and the connector's counters; writes JSON (``--out``).

    python scripts/bench/bench_vllm_cost_guard.py --out docs/bench/vllm_cost_guard.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.fault_proxy import FaultProxy
from scripts.fleet.vllm_fleet import VLLMServer, kvcloud_transfer_config, settled, wait_stored

# phase: the proxy's mode. "miss": prompts never stored, the store fast: what the connector
# costs a request it computes (its lookup, and the step's copies of the chunks it saves)
PHASES = {"fast": "pass", "throttled": "throttle", "miss": "pass"}
COUNTERS = (
    "hits_skipped_by_cost",
    "hit_tokens_skipped_by_cost",
    "cost_probes",
    "loaded_tokens",
    "load_timeouts",
    "loads_skipped",
    "store_breaker_opened",
)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def reset(server: VLLMServer) -> None:
    httpx.post(server.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--requests", type=int, default=5, help="prompts per phase")
    ap.add_argument("--throttle-mbps", type=float, default=2.0)
    a = ap.parse_args()
    from tests.servers import s3_env, start_moto, start_redis

    work = Path(tempfile.mkdtemp(prefix="kvcloud-cost-guard-"))
    moto, redis = start_moto(work / "moto"), start_redis(work / "redis")
    proxy = FaultProxy(moto.port, rate=a.throttle_mbps * 1e6)
    endpoint = f"http://127.0.0.1:{proxy.port}"
    os.environ.update(s3_env(endpoint))  # this process reads the index and store too
    env = {
        **s3_env(endpoint),
        "KVCLOUD_STORE": f"s3://kvcloud/guard?endpoint_url={endpoint}&region=us-east-1"
        "&create_bucket=true",
        "KVCLOUD_INDEX": redis.url,
        "KVCLOUD_SECRET": "cost-guard-secret",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    cfg = kvcloud_transfer_config()
    servers = {
        "guard": VLLMServer("G", work / "G.log", transfer=cfg, env=env),
        "no guard": VLLMServer(
            "O", work / "O.log", transfer=cfg, env={**env, "KVCLOUD_COST_MARGIN": "0"}
        ),
        "plain": VLLMServer("P", work / "P.log", env={"VLLM_SERVER_DEV_MODE": "1"}),
    }
    results: dict[str, Any] = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M"),
                                        "command": " ".join(sys.argv)}}  # fmt: skip
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
        connected = [servers["guard"], servers["no guard"]]
        # warm-up: the same prompt lengths on every server (a cold engine's first prefills
        # are slow), which also gives the guarded server its prefill rate
        for i in range(2):
            for s in servers.values():
                s.complete(tokens(a.tokens + 16, seed=100 + i), max_tokens=1)
        prompts = {
            phase: [tokens(a.tokens + 16, seed=1000 * k + i) for i in range(a.requests)]
            for k, phase in enumerate(PHASES, start=1)
        }
        store_env = {k: v for k, v in env.items() if k.startswith(("KVCLOUD_", "AWS_"))}
        for phase_prompts in (prompts["fast"], prompts["throttled"]):  # "miss": never stored
            for p in phase_prompts:  # stored by the unguarded server
                servers["no guard"].complete(p, max_tokens=1)
            for p in phase_prompts:
                assert wait_stored(store_env, p) == a.tokens // 256, "not stored"
        settled(connected, timeout=300)
        for phase, mode in PHASES.items():
            proxy.set_mode(mode)
            before = {n: s.metrics() for n, s in servers.items() if n != "plain"}
            ttft: dict[str, list[float]] = {n: [] for n in servers}
            for p in prompts[phase]:
                for name, s in servers.items():
                    reset(s)
                    ttft[name].append(s.complete(p, max_tokens=1)["elapsed_s"])
                    # the connector servers' uploads of what they computed run at nice 19,
                    # but on 2 cores any runnable thread stalls vLLM's OpenMP prefill: the
                    # next request is timed only once they are done
                    settled(connected, timeout=300)
                print(phase, {n: round(v[-1], 2) for n, v in ttft.items()}, flush=True)
            counters = {
                n: {k: s.metrics().get(k, 0) - before[n].get(k, 0) for k in COUNTERS}
                for n, s in servers.items()
                if n != "plain"
            }
            med = {n: statistics.median(v) for n, v in ttft.items()}
            # per prompt, each server's TTFT over plain's on that prompt: the prompts' own
            # spread (and this machine's drift between them) cancels
            paired = {
                n: statistics.median(x / y for x, y in zip(ttft[n], ttft["plain"], strict=True))
                for n in servers
            }
            results[phase] = {
                "ttft_s": ttft,
                "median_s": med,
                "vs_plain": {n: med[n] / med["plain"] for n in servers},
                "paired_vs_plain": paired,
                "counters": counters,
            }
    finally:
        for s in servers.values():
            s.stop()
        proxy.close()
        redis.stop()
        moto.stop()
    rows = ["| phase | plain TTFT (s) | guard | no guard | guard ÷ plain | no guard ÷ plain "
            "| guard ÷ plain, per prompt | no guard ÷ plain, per prompt | guard's counters |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for phase in PHASES:
        r = results[phase]
        m, v, pv = r["median_s"], r["vs_plain"], r["paired_vs_plain"]
        c = ", ".join(f"{k} {int(x)}" for k, x in r["counters"]["guard"].items() if x) or "–"
        rows.append(
            f"| {phase} | {m['plain']:.2f} | {m['guard']:.2f} | {m['no guard']:.2f} "
            f"| {v['guard']:.2f}× | {v['no guard']:.2f}× | {pv['guard']:.2f}× "
            f"| {pv['no guard']:.2f}× | {c} |"
        )
    print("\n".join(rows))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
