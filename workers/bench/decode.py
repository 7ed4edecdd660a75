"""`kvcloud-worker bench decode`: decode tokens/s with the uploader idle vs busy pushing pages."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..config import WorkerOptions
from ..engine import CompletionRequest, Engine
from ..engine.uploader import UploadItem
from .backends import open_backends
from .common import machine, prompt_for


def run_decode_bench(
    model: str = "small",
    tokens: int = 48,
    prompt_tokens: int = 512,
    upload_pages: int = 48,
    rounds: int = 3,
    backend: str = "file",
    chunk_tokens: int = 256,
    workdir: Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Decode tokens/s with an idle uploader vs one pushing ``upload_pages`` pages."""
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvcloud-bench-")) if own else Path(workdir)
    try:
        with open_backends([backend], wd) as (b,):
            pages = (prompt_tokens + tokens) // chunk_tokens + 4
            eng = Engine(
                WorkerOptions(
                    model=model,
                    store=b.store,
                    index=b.index,
                    cache_pages=pages,
                    chunk_tokens=chunk_tokens,
                    upload_queue=upload_pages + 8,
                    worker_id="bench",
                )
            )
            assert eng.uploader is not None
            rng = np.random.default_rng(7)
            idle, busy, busy_depth = [], [], []
            for rnd in range(rounds):
                for mode in ("idle", "busy"):
                    if mode == "busy":
                        for _ in range(upload_pages):
                            arr = rng.integers(
                                0, 2**16, eng.ns.kv_shape(chunk_tokens), dtype=np.uint16
                            ).view(np.float16)
                            eng.uploader.offer(UploadItem(rng.bytes(32), eng.ns.digest, arr))
                    p = prompt_for(prompt_tokens, 500 + 2 * rnd + (mode == "busy"))
                    r = eng.complete(
                        CompletionRequest(prompt_tokens=p, max_tokens=tokens, stop_at_eos=False)
                    )
                    rate = (tokens - 1) / ((r.total_ms - r.ttft_ms) / 1000.0)
                    (busy if mode == "busy" else idle).append(rate)
                    if mode == "busy":
                        busy_depth.append(eng.uploader.depth)
                    eng.uploader.drain(120)
                log(f"round {rnd + 1}: idle {idle[-1]:.1f} tok/s, busy {busy[-1]:.1f} tok/s")
            eng.close()
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    mi, mb = statistics.median(idle), statistics.median(busy)
    return {
        "bench": "decode",
        "model": model,
        "backend": backend,
        "tokens": tokens,
        "upload_pages": upload_pages,
        "idle_tok_s": idle,
        "busy_tok_s": busy,
        "queue_left_after_busy_run": busy_depth,
        "median_idle": mi,
        "median_busy": mb,
        "cost_pct": 100.0 * (1 - mb / mi),
        "machine": machine(),
    }


def decode_markdown(report: dict[str, Any]) -> str:
    return (
        f"| decode tokens/s ({report['model']}, {report['backend']} store) | median |\n"
        f"|---|---|\n| uploader idle | {report['median_idle']:.1f} |\n"
        f"| uploader busy ({report['upload_pages']} pages queued) | "
        f"{report['median_busy']:.1f} |\n| cost | **{report['cost_pct']:.1f} %** |"
    )
