"""What a sick index or store costs a vLLM with the kvcloud connector, measured.

One vLLM server with the connector, its index (redis-server) and store (moto_server, S3 over
HTTP) each behind a fault proxy (scripts/fleet/fault_proxy.py). Each phase runs the same workload:
two long greedy streams decoding, and meanwhile new requests arriving one after another
(``max_tokens=1``), each with a 512-token prefix kvcloud holds (vLLM's own prefix cache is
reset before each phase, so the hit can only come from kvcloud). Phases:

- ``healthy``: both answer; the new requests restore their prefix;
- ``recompute``: both answer, but the new requests' prefixes were never stored (the cost of
  a miss, for comparison);
- ``no connector``: the recompute workload on a second vLLM started without any KV connector
  (same flags otherwise), the engine's own behaviour under these arrivals, independent of
  kvcloud;
- ``index refused`` / ``index blackholed`` / ``index slow`` (200 ms added per request);
- ``store slow`` (200 ms) / ``store refused`` / ``store blackholed``.

Per phase: the connector's time on vLLM's scheduler thread per new request (its own
``vllm:kvcloud_scheduler_us_total`` counter), each new request's latency, and the inter-token
latency (ITL) of the running streams (p50, p99, max), with the ratio of the phase's worst ITL
to the healthy phase's median. Writes JSON (``--out``) and prints a table.

    python scripts/bench/vllm_faults.py --out docs/bench/vllm_faults.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.fault_proxy import FaultProxy
from scripts.fleet.vllm_fleet import VLLMServer, kvcloud_transfer_config, wait_stored

PHASES = [
    ("healthy", "pass", "pass", True),
    ("recompute", "pass", "pass", False),
    ("no connector", "-", "-", False),
    ("index refused", "refuse", "pass", True),
    ("index blackholed", "blackhole", "pass", True),
    ("index slow", "slow", "pass", True),
    ("store slow", "pass", "slow", True),
    ("store refused", "pass", "refuse", True),
    ("store blackholed", "pass", "blackhole", True),
]
COUNTERS = (
    "scheduler_us",
    "lookups",
    "lookup_deferrals",
    "lookup_timeouts",
    "lookup_errors",
    "lookups_skipped",
    "loads_skipped",
    "loads_refused",
    "load_timeouts",
    "loaded_tokens",
    "load_failed_blocks",
    "index_breaker_opened",
    "store_breaker_opened",
)


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(200, 48_000) for _ in range(n)]


def stream_itl(server: VLLMServer, prompt: list[int], max_tokens: int, out: list[float]) -> None:
    """Stream a greedy completion; append the gaps between tokens (seconds) to ``out``."""
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    last = None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            last = now


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Bench:
    def __init__(
        self, work: Path, new_requests: int, stream_tokens: int, vllm_args: list[str]
    ) -> None:
        from tests.servers import s3_env, start_moto, start_redis

        self.work = work
        self.new_requests = new_requests
        self.stream_tokens = stream_tokens
        self.moto = start_moto(work / "moto")
        self.redis = start_redis(work / "redis")
        self.s3_proxy = FaultProxy(self.moto.port)
        self.index_proxy = FaultProxy(self.redis.port)
        endpoint = f"http://127.0.0.1:{self.s3_proxy.port}"
        os.environ.update(s3_env(endpoint))
        self.env = {
            **s3_env(endpoint),
            "KVCLOUD_STORE": f"s3://kvcloud/faults?endpoint_url={endpoint}&region=us-east-1"
            "&create_bucket=true",
            "KVCLOUD_INDEX": f"redis://127.0.0.1:{self.index_proxy.port}/0",
            "KVCLOUD_SECRET": "faults-secret",
            # short backoff windows, so the next phase does not wait out the last one's
            "KVCLOUD_BREAKER_MAX_BACKOFF": "4",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between phases
        }
        self.server = VLLMServer(
            "F", work / "F.log", transfer=kvcloud_transfer_config(), env=self.env, args=vllm_args
        )
        # the independent reference: the same engine and flags, no connector at all
        self.plain = VLLMServer(
            "FP", work / "FP.log", env={"VLLM_SERVER_DEV_MODE": "1"}, args=vllm_args
        )
        self.server.start()
        self.plain.start()
        self.server.wait_ready()
        self.plain.wait_ready()
        self.prefixes = [tokens(512, seed=1000 + i) for i in range(new_requests)]
        for p in self.prefixes:
            self.server.complete(p, max_tokens=1)
        # the same first requests warm the reference (a cold engine's first prefills are slow)
        for i in range(3):
            self.plain.complete(tokens(522, seed=4000 + i), max_tokens=8)
        direct = {**self.env, "KVCLOUD_STORE": self.env["KVCLOUD_STORE"]}
        for p in self.prefixes:
            assert wait_stored(direct, p) == 2, "the prefixes were not stored"
        self.fresh_seed = 5000

    def metrics(self) -> dict[str, float]:
        return self.server.metrics()

    def recover(self) -> None:
        """Both healthy again, and both breakers closed (a probe has gone through)."""
        self.index_proxy.set_mode("pass")
        self.s3_proxy.set_mode("pass")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = httpx.get(self.server.url + "/metrics", timeout=10).text
            names = ("vllm:kvcloud_index_breaker_open", "vllm:kvcloud_store_breaker_open")
            gauges = [
                float(line.rpartition("}")[2].split()[0])
                for line in text.splitlines()
                if line.split("{")[0].split(" ")[0] in names
            ]
            if not any(g >= 1 for g in gauges):  # 1: open
                return
            # a stored prefix, not in vLLM's own cache: a lookup and a load, so each
            # breaker gets its probe
            httpx.post(self.server.url + "/reset_prefix_cache", timeout=30).raise_for_status()
            self.fresh_seed += 1
            prompt = [*self.prefixes[0], *tokens(10, self.fresh_seed)]
            self.server.complete(prompt, max_tokens=1)
            time.sleep(0.5)
        raise RuntimeError(f"the breakers did not close within 60 s of recovery: {gauges}")

    def phase(self, name: str, index_mode: str, store_mode: str, stored: bool) -> dict[str, Any]:
        self.recover()
        server = self.plain if name == "no connector" else self.server
        httpx.post(server.url + "/reset_prefix_cache", timeout=30).raise_for_status()
        before = server.metrics()
        self.index_proxy.set_mode(index_mode if index_mode != "-" else "pass")
        self.s3_proxy.set_mode(store_mode if store_mode != "-" else "pass")
        itl: list[float] = []
        streams = [tokens(64, seed=9000 + i) for i in range(2)]
        latencies: list[float] = []
        with cf.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(stream_itl, server, s, self.stream_tokens, itl) for s in streams]
            time.sleep(1.0)  # the streams are decoding
            for i in range(self.new_requests):
                if stored:
                    prompt = [*self.prefixes[i], *tokens(10, seed=7000 + i)]
                else:
                    self.fresh_seed += 1
                    prompt = tokens(522, seed=self.fresh_seed)
                t0 = time.perf_counter()
                server.complete(prompt, max_tokens=1)
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.3)
            for f in futs:
                f.result()
        after = server.metrics()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
        return {
            "phase": name,
            "index": index_mode,
            "store": store_mode,
            "new_requests": self.new_requests,
            "scheduler_ms_per_new_request": delta["scheduler_us"] / 1000 / self.new_requests,
            "new_request_latency_ms": {
                "p50": 1000 * statistics.median(latencies),
                "max": 1000 * max(latencies),
            },
            "itl_ms": {
                "p50": 1000 * statistics.median(itl),
                "p99": 1000 * pct(itl, 0.99),
                "max": 1000 * max(itl),
                "n": len(itl),
            },
            "counters": delta,
        }

    def close(self) -> None:
        self.server.stop()
        self.plain.stop()
        self.s3_proxy.close()
        self.index_proxy.close()
        self.redis.stop()
        self.moto.stop()


def table(results: list[dict[str, Any]]) -> str:
    """The phases as a markdown table; each phase's worst ITL against the healthy median, a
    miss's worst with the connector (``recompute``) and the engine's own worst with no
    connector at all (``no connector``)."""
    healthy = next(r for r in results if r["phase"] == "healthy")
    base = healthy["itl_ms"]["p50"]
    miss = next((r for r in results if r["phase"] == "recompute"), healthy)["itl_ms"]["max"]
    plain = next((r for r in results if r["phase"] == "no connector"), None)
    rows = [
        "| phase | scheduler ms / new request | new request p50 / max (ms) "
        "| ITL p50 / p99 / max (ms) | worst ITL ÷ healthy p50 | worst ITL ÷ recompute's worst "
        "| worst ITL ÷ no connector's worst | what the connector did |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        c = {k: int(v) for k, v in r["counters"].items() if v and k != "scheduler_us"}
        itl, lat = r["itl_ms"], r["new_request_latency_ms"]
        vs_plain = f"{itl['max'] / plain['itl_ms']['max']:.2f}×" if plain else "–"
        rows.append(
            f"| {r['phase']} | {r['scheduler_ms_per_new_request']:.2f} "
            f"| {lat['p50']:.0f} / {lat['max']:.0f} "
            f"| {itl['p50']:.0f} / {itl['p99']:.0f} / {itl['max']:.0f} "
            f"| {itl['max'] / base:.2f}× | {itl['max'] / miss:.2f}× | {vs_plain} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(c.items())) or '–'} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--new-requests", type=int, default=6)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--phases", default="", help="comma-separated subset (healthy always runs)")
    ap.add_argument(
        "--vllm-args", default="", help="extra vLLM flags for both servers, space-separated"
    )
    a = ap.parse_args()
    wanted = {p.strip() for p in a.phases.split(",") if p.strip()}
    work = Path(tempfile.mkdtemp(prefix="kvcloud-vllm-faults-"))
    bench = Bench(work, a.new_requests, a.stream_tokens, a.vllm_args.split())
    results = []
    try:
        for name, index_mode, store_mode, stored in PHASES:
            if wanted and name not in wanted and name != "healthy":
                continue
            r = bench.phase(name, index_mode, store_mode, stored)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        bench.close()
    print(table(results))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
        a.out.write_text(json.dumps({"meta": meta, "phases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
