"""`kvcloud-worker bench ttft`: time to first token, recompute vs restore across processes.

For each prefix length a fresh random prompt is prefilled by one process (that run is the
*recompute* figure: no store, nothing cached) which then pushes the KV to every backend; the
measuring process, which has never seen the prompt, then answers it by restoring from
kvcloud (*restore*), and by what a user writes by hand (*naive*: one ``torch.save`` blob per
chunk, sequential GETs, one index round trip per chunk). All methods answer the same prompt
with the same model; ratios are taken inside one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvcloud import KVCloud
from kvcloud.urls import redact_url

from ..engine import CompletionRequest, Engine
from .backends import Backend, open_backends
from .common import bench_engine, machine, prompt_for
from .naive import NaiveStore


class RssSampler:
    """Peak resident memory of this process while a block runs (sampled every ~1 ms)."""

    def __init__(self) -> None:
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.before = self.peak = self.rss()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> RssSampler:
        self.before = self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return self.peak - self.before


# --- the pushing process -----------------------------------------------------------------------


def push_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Child process: recompute every prompt (timed), then push its KV to every backend."""
    backends = [Backend(**b) for b in spec["backends"]]
    c = spec["chunk_tokens"]
    pages = max(spec["lengths"]) // c + 4
    eng = bench_engine(spec["model"], None, None, pages, chunk_tokens=c)
    clients = [KVCloud.open(store=b.store, index=b.index) for b in backends]
    naive = [NaiveStore(b) for b in backends]
    recompute: dict[str, list[float]] = {}
    for length in spec["lengths"]:
        for rep in range(spec["repeat"]):
            p = prompt_for(length, rep)
            r = eng.complete(CompletionRequest(prompt_tokens=p, max_tokens=1))
            recompute.setdefault(str(length), []).append(r.ttft_ms)
            for kv in clients:
                eng.push_cached_pages(kv)
            fps = eng._fps(p, "default")
            for j in range(len(p) // c):
                cp = eng.prefix.get(fps[j])
                assert cp is not None
                for ns_ in naive:
                    ns_.put(p[: (j + 1) * c], eng.pool.data[cp.page])
            eng.clear_cache()  # the next prompt must not share this one's pages
    for kv in clients:
        kv.close()
    return {"recompute_ms": recompute}


# --- the measuring process ---------------------------------------------------------------------


def _naive_restore(eng: Engine, store: NaiveStore, p: list[int]) -> tuple[float, int]:
    """Sequentially load chunks into the engine's pages; returns (ms, tokens restored)."""
    c = eng.c
    t0 = time.perf_counter()
    fps = eng._fps(p, "default")
    restored = 0
    for j in range(len(p) // c):
        t = store.get(p[: (j + 1) * c])
        if t is None:
            break
        page = eng._alloc()
        eng.pool.data[page].copy_(t)
        eng.prefix.insert(fps[j], fps[j - 1] if j else eng.ns.digest, page, stored=True)
        eng.prefix.release(fps[j])
        restored += c
    return (time.perf_counter() - t0) * 1000.0, restored


def _restore_rounds(
    b: Backend,
    lengths: list[int],
    model: str,
    chunk_tokens: int,
    naive: bool,
    restore_repeat: int,
) -> dict[str, Any]:
    """kvcloud restores from one backend and, when ``naive``, the hand-written path from the
    same backend, in the same rounds and in alternating order, so neither method always runs
    first (warm-up, allocator and page-cache effects land on both alike)."""
    pages = max(lengths) // chunk_tokens + 4
    eng = bench_engine(model, b.store, b.index, pages, chunk_tokens=chunk_tokens)
    naive_eng = bench_engine(model, None, None, pages, chunk_tokens=chunk_tokens)  # no store
    naive_store = NaiveStore(b) if naive else None
    rows: dict[str, list[float]] = {}
    naive_rows: dict[str, list[float]] = {}
    remote: dict[str, int] = {}
    memory: dict[str, dict[str, float]] = {}

    def kvcloud_restore(length: int) -> None:
        eng.clear_cache()
        r = eng.complete(CompletionRequest(prompt_tokens=prompt_for(length, 0), max_tokens=1))
        rows.setdefault(str(length), []).append(r.ttft_ms)

    def sampled_restore(length: int) -> None:
        # untimed: the sampler thread wakes every millisecond, which slowed the timed
        # forward by ~3 ms when it ran inside the timed restores
        eng.clear_cache()
        with RssSampler() as rss:
            r = eng.complete(CompletionRequest(prompt_tokens=prompt_for(length, 0), max_tokens=1))
        restored = r.tokens_remote * eng.ns.bytes_per_token
        remote[str(length)] = r.tokens_remote
        memory[str(length)] = {
            "restored_bytes": restored,
            "peak_extra_rss_bytes": rss.extra,
            "ratio": rss.extra / restored if restored else float("nan"),
        }

    def naive_restore(length: int) -> None:
        assert naive_store is not None
        p = prompt_for(length, 0)
        naive_eng.clear_cache()
        ms, _ = _naive_restore(naive_eng, naive_store, p)
        r = naive_eng.complete(CompletionRequest(prompt_tokens=p, max_tokens=1))
        naive_rows.setdefault(str(length), []).append(ms + r.ttft_ms)

    try:
        # recompute is measured once per length (it is the slow part); restores are repeated
        # on the same pushed prompt after dropping the local cache
        for length in lengths:
            sampled_restore(length)
        for rep in range(restore_repeat):
            for length in lengths:
                if naive_store is not None and rep % 2:
                    naive_restore(length)
                kvcloud_restore(length)
                if naive_store is not None and not rep % 2:
                    naive_restore(length)
    finally:
        eng.close()
        naive_eng.close()
    out: dict[str, Any] = {
        f"memory:{b.name}": memory,
        f"restore:{b.name}": rows,
        f"restored_tokens:{b.name}": remote,
    }
    if naive:
        out[f"naive:{b.name}"] = naive_rows
    return out


def run_ttft_bench(
    lengths: list[int],
    backends: list[str],
    model: str = "small",
    repeat: int = 1,
    chunk_tokens: int = 256,
    naive: bool = True,
    workdir: Path | None = None,
    log: Any = print,
    restore_repeat: int = 3,
) -> dict[str, Any]:
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvcloud-bench-")) if own else Path(workdir)
    try:
        with open_backends(backends, wd) as bks:
            spec = {
                "backends": [asdict(b) for b in bks],
                "lengths": lengths,
                "repeat": repeat,
                "model": model,
                "chunk_tokens": chunk_tokens,
            }
            log(f"prefilling {len(lengths) * repeat} prompts in a pusher process (recompute) …")
            out = subprocess.run(
                [sys.executable, "-m", "workers.bench", "_push"],
                input=json.dumps(spec),
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                raise RuntimeError(f"pusher failed:\n{out.stderr[-4000:]}")
            pushed = json.loads(out.stdout.strip().splitlines()[-1])
            results: dict[str, Any] = {"recompute": pushed["recompute_ms"]}
            for b in bks:
                log(f"restoring from {b.name} …" + (" and naive restore" if naive else ""))
                results.update(
                    _restore_rounds(b, lengths, model, chunk_tokens, naive, restore_repeat)
                )
            report = summarise(results, lengths, backends, model, chunk_tokens, repeat, bks)
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    return report


def summarise(
    results: dict[str, Any],
    lengths: list[int],
    backends: list[str],
    model: str,
    chunk_tokens: int,
    repeat: int,
    bks: list[Backend],
) -> dict[str, Any]:
    def med(method: str, length: int) -> float | None:
        vals = results.get(method, {}).get(str(length))
        return statistics.median(vals) if vals else None

    methods = [m for m in results if not m.startswith(("restored_tokens", "memory"))]
    table = []
    for length in lengths:
        row: dict[str, Any] = {"prefix_tokens": length}
        base = med("recompute", length)
        for m in methods:
            v = med(m, length)
            row[f"{m}_ms"] = v
            if m != "recompute" and v and base:
                row[f"speedup_{m}"] = base / v
        for b in backends:
            row[f"restored_tokens:{b}"] = results.get(f"restored_tokens:{b}", {}).get(str(length))
            mem = results.get(f"memory:{b}", {}).get(str(length))
            if mem:
                row[f"restore_extra_rss_ratio:{b}"] = mem["ratio"]
        table.append(row)
    return {
        "bench": "ttft",
        "model": model,
        "chunk_tokens": chunk_tokens,
        "repeat": repeat,
        "backends": {
            b.name: {"store": redact_url(b.store), "index": redact_url(b.index)} for b in bks
        },
        "machine": machine(),
        "rows": table,
        "raw_ms": {k: v for k, v in results.items() if k in methods},
        "memory": {k: v for k, v in results.items() if k.startswith("memory")},
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    xs = [r["prefix_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in rows[0]:
        if key.endswith("_ms"):
            ys = [r[key] for r in rows]
            style = (
                "-o" if key.startswith("restore") else ("--s" if key.startswith("naive") else "-k^")
            )
            ax.plot(xs, ys, style, label=key[:-3])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"TTFT, model {report['model']}: recompute vs restore across processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = report["rows"]
    methods = [k[:-3] for k in rows[0] if k.endswith("_ms")]
    t = Table(title=f"TTFT (ms, median of {report['repeat']}), model {report['model']}")
    t.add_column("prefix")
    for m in methods:
        t.add_column(m, justify="right")
    for r in rows:
        cells = [f"{r['prefix_tokens']:,}"]
        for m in methods:
            v = r[f"{m}_ms"]
            sp = r.get(f"speedup_{m}")
            cells.append("-" if v is None else (f"{v:,.0f}" + (f" ({sp:.1f}×)" if sp else "")))
        t.add_row(*cells)
    Console().print(t)


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "–" if v is None else format(v, spec)


def ttft_markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    methods = [k[:-3] for k in rows[0] if k.endswith("_ms")]
    head = "| prefix tokens | " + " | ".join(f"{m} (ms)" for m in methods) + " |"
    lines = [head, "|" + "---|" * (len(methods) + 1)]
    for r in rows:
        cells = []
        for m in methods:
            v, sp = r[f"{m}_ms"], r.get(f"speedup_{m}")
            cells.append(_fmt(v) + (f" (**{sp:.1f}×**)" if sp else ""))
        lines.append(f"| {r['prefix_tokens']:,} | " + " | ".join(cells) + " |")
    mem = report.get("memory", {})
    if mem:
        lines += [
            "",
            "| restore: peak extra RSS / restored bytes | "
            + " | ".join(f"{r['prefix_tokens']:,}" for r in rows)
            + " |",
            "|" + "---|" * (len(rows) + 1),
        ]
        for key, per_len in mem.items():
            cells = [
                _fmt(per_len.get(str(r["prefix_tokens"]), {}).get("ratio"), ".2f") for r in rows
            ]
            lines.append(f"| {key.split(':', 1)[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
