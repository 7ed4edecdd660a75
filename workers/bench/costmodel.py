"""`kvcloud-worker bench costmodel`: never slower than recompute. A store throttled to a rate
(the ``netem`` shaping proxy in front of moto_server): does the engine's cost model stop
restoring while the store is slow, and resume once it is fast again?"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcloud import KVCloud

from ..engine import CompletionRequest
from .backends import local_servers
from .common import bench_engine, machine, prompt_for


def _push_prompts(
    model: str, store: str, index: str, prompts: list[list[int]], chunk_tokens: int
) -> list[float]:
    """Prefill every prompt with no store (the plain-recompute figure) and push its pages."""
    pages = max(len(p) for p in prompts) // chunk_tokens + 4
    eng = bench_engine(model, None, None, pages, chunk_tokens=chunk_tokens)
    ttfts = []
    with KVCloud.open(store=store, index=index) as kv:
        for p in prompts:
            ttfts.append(eng.complete(CompletionRequest(prompt_tokens=p, max_tokens=1)).ttft_ms)
            eng.push_cached_pages(kv)
    eng.close()
    return ttfts


def run_costmodel_bench(
    model: str = "small",
    prefix_tokens: int = 256,
    rate: float = 10e6,
    per_phase: int = 6,
    chunk_tokens: int = 256,
    workdir: Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Phases: store fast → throttled to ``rate`` bytes/s → fast again. Each request is a new
    prompt whose KV is in the store; we record what the engine chose and its TTFT."""
    from .netem import ShapingProxy

    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvcloud-bench-")) if own else Path(workdir)
    phases = [("fast", None), ("throttled", rate), ("recovered", None)]
    n_prompts = per_phase * (len(phases) + 1) + 2
    prompts = [prompt_for(prefix_tokens, 10_000 + i) for i in range(n_prompts)]
    try:
        with (
            local_servers(wd / "servers") as srv,
            ShapingProxy("127.0.0.1", int(srv.s3_endpoint.rsplit(":", 1)[1])) as proxy,
        ):
            direct = (
                f"s3://kvbench/cost?endpoint_url={srv.s3_endpoint}&region=us-east-1"
                "&create_bucket=true"
            )
            shaped = f"s3://kvbench/cost?endpoint_url={proxy.endpoint}&region=us-east-1"
            log(f"prefilling and pushing {len(prompts)} prompts of {prefix_tokens} tokens …")
            recompute = _push_prompts(model, direct, srv.redis_url, prompts, chunk_tokens)
            base = statistics.median(recompute)
            pages = prefix_tokens // chunk_tokens + 4
            eng = bench_engine(
                model, shaped, srv.redis_url, pages, chunk_tokens=chunk_tokens, remote_timeout=5.0
            )
            naive_eng = bench_engine(
                model,
                shaped,
                srv.redis_url,
                pages,
                chunk_tokens=chunk_tokens,
                remote_timeout=5.0,
                cost_model=False,
            )
            it = iter(prompts[2:])
            # two warm-up requests teach the model the fast store
            for p in prompts[:2]:
                eng.complete(CompletionRequest(prompt_tokens=p, max_tokens=1))
            out: dict[str, Any] = {"plain_recompute_ms": base, "phases": []}
            for name, r in phases:
                proxy.set_rate(r)
                log(f"phase {name}: store at {'full speed' if r is None else f'{r / 1e6:g} MB/s'}")
                rows = []
                for k in range(per_phase):
                    p = next(it)
                    res = eng.complete(CompletionRequest(prompt_tokens=p, max_tokens=1))
                    rows.append(
                        {
                            "ttft_ms": res.ttft_ms,
                            "restored": res.tokens_remote,
                            "bandwidth_MBps": (eng.cost.bandwidth or 0) / 1e6,
                        }
                    )
                    if name == "recovered":
                        time.sleep(eng.cost.probe_interval / 2)  # requests keep arriving
                    del k
                ttfts = [x["ttft_ms"] for x in rows]
                phase: dict[str, Any] = {
                    "phase": name,
                    "rate_MBps": None if r is None else r / 1e6,
                    "requests": rows,
                    "median_ttft_ms": statistics.median(ttfts),
                    "ratio_to_recompute": statistics.median(ttfts) / base,
                    "restored_requests": sum(1 for x in rows if x["restored"]),
                }
                if name == "throttled":
                    p = next(it)
                    blind = naive_eng.complete(CompletionRequest(prompt_tokens=p, max_tokens=1))
                    phase["without_cost_model_ttft_ms"] = blind.ttft_ms
                    phase["without_cost_model_ratio"] = blind.ttft_ms / base
                if name == "recovered":
                    first = next((i for i, x in enumerate(rows) if x["restored"]), None)
                    phase["requests_until_restore_resumed"] = first
                out["phases"].append(phase)
            eng.close()
            naive_eng.close()
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    out.update(
        {"bench": "costmodel", "model": model, "prefix_tokens": prefix_tokens, "machine": machine()}
    )
    return out


def costmodel_markdown(report: dict[str, Any]) -> str:
    base = report["plain_recompute_ms"]
    out = [
        f"plain recompute of a {report['prefix_tokens']}-token prefix: {base:,.0f} ms (median)",
        "",
        "| phase | store | requests restored | median TTFT ms | ratio to recompute |",
        "|---|---|---|---|---|",
    ]
    for ph in report["phases"]:
        rate = "full speed" if ph["rate_MBps"] is None else f"{ph['rate_MBps']:g} MB/s"
        out.append(
            f"| {ph['phase']} | {rate} | {ph['restored_requests']} of "
            f"{len(ph['requests'])} | {ph['median_ttft_ms']:,.0f} | "
            f"**{ph['ratio_to_recompute']:.2f}×** |"
        )
    thr = next(p for p in report["phases"] if p["phase"] == "throttled")
    rec = next(p for p in report["phases"] if p["phase"] == "recovered")
    out += [
        "",
        f"Without the cost model, the throttled store gives a TTFT of "
        f"{thr['without_cost_model_ttft_ms']:,.0f} ms "
        f"({thr['without_cost_model_ratio']:.2f}× recompute). After recovery, restores "
        f"resumed at request {rec['requests_until_restore_resumed']} "
        "(0 = the first one).",
    ]
    return "\n".join(out)
