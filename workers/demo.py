"""`make demo`: a session moves between two worker processes.

Worker A holds a multi-turn conversation and is stopped with SIGTERM (which flushes the
session to kvcloud); worker B continues it. A reference worker R runs the same conversation
without interruption, and worker C (no store) answers the last turn by recomputing the whole
history. The table shows what B restored vs recomputed, TTFT on B vs C, and whether B's
output is bit-identical to R's.

Runs on the embedded default (file:// + sqlite:// under .kvcloud-demo/), or against MinIO +
Redis when KVCLOUD_STORE / KVCLOUD_INDEX are set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()

DOCUMENT = (
    "Chapter {i}. The inference engine keeps its memory across a restart. A worker that "
    "evicts a segment of its KV cache writes it to shared storage first, keyed by the "
    "fingerprint of the prefix it encodes, so that any other worker can find it again. "
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(
    port: int, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 600
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


class Worker:
    def __init__(
        self,
        name: str,
        model: str,
        store: str | None,
        index: str | None,
        log_dir: Path,
        cache_pages: int,
        port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port or _free_port()
        argv = [
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            "--worker-id",
            name,
            "--cache-pages",
            str(cache_pages),
        ]
        env = dict(os.environ)
        if store:
            argv += ["--store", store, "--index", index or ""]
        else:
            env.pop("KVCLOUD_STORE", None)
            env.pop("KVCLOUD_INDEX", None)
            argv += ["--store", "none"]
        self.log_path = log_dir / f"worker-{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited; see {self.log_path}")
            try:
                _call(self.port, "GET", "/healthz", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        raise RuntimeError(f"worker {self.name} did not become ready; see {self.log_path}")

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return _call(self.port, "POST", "/v1/completions", body)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return time.monotonic() - t0


def _turns(total_chars: int) -> list[str]:
    doc = "".join(DOCUMENT.format(i=i) for i in range(1, 200))
    first = doc[: int(total_chars * 0.6)]
    second = doc[int(total_chars * 0.6) : int(total_chars * 0.92)]
    return [
        f"Read this document.\n{first}\nSummarise chapter 1.",
        f"Here is more of it.\n{second}\nWhat changed?",
        "Thank you. Now, in one sentence: why is restoring cheaper than recomputing?",
    ]


# Prometheus's discovery manager hands new targets to the scrapers at most every 5 s.
DISCOVERY_SECONDS = 6.0


class ScrapeTargets:
    """A Prometheus ``file_sd_configs`` file listing the demo's workers (all four, with
    ports chosen up front, so Prometheus discovers them once, before any starts: a worker
    found only after it started could finish its work unseen). Written atomically, since
    Prometheus may read it at any moment; removed when the demo ends."""

    def __init__(self, path: Path, ports: dict[str, int]) -> None:
        self.path = path
        groups = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"worker": f"demo-{name}"}}
            for name, port in ports.items()
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(groups, indent=2) + "\n")
        os.replace(tmp, path)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def run(
    model: str,
    total_chars: int,
    max_tokens: int,
    workdir: Path,
    prometheus_sd: Path | None = None,
    scrape_wait: float = 0.0,
) -> int:
    store = os.environ.get("KVCLOUD_STORE")
    index = os.environ.get("KVCLOUD_INDEX")
    if not store:
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        store = f"file://{(workdir / 'objects').resolve()}"
        index = f"sqlite://{(workdir / 'index.db').resolve()}"
    else:
        workdir.mkdir(parents=True, exist_ok=True)
    pages = max(64, total_chars // 256 + 16)
    turns = _turns(total_chars)
    gen = {"max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    console.print(f"[b]kvcloud demo[/b]: model [cyan]{model}[/], store {store.split('?')[0]}")
    workers: list[Worker] = []
    ports = {name: _free_port() for name in ("a", "r", "b", "c")}
    targets: ScrapeTargets | None = None

    def started(w: Worker) -> Worker:
        workers.append(w)
        # let Prometheus take a sample before the worker does anything, so rate() sees the
        # whole of what it does (a series' first sample has no increase before it)
        time.sleep(scrape_wait)
        return w

    def stop(w: Worker) -> None:
        time.sleep(scrape_wait)  # ...and one after, before the worker is gone
        w.stop()
        workers.remove(w)

    try:
        if prometheus_sd is not None:
            targets = ScrapeTargets(prometheus_sd, ports)
            console.print(
                f"Prometheus scrape targets in {prometheus_sd}; "
                f"giving Prometheus {DISCOVERY_SECONDS:.0f} s to discover them …"
            )
            time.sleep(DISCOVERY_SECONDS)
        console.print("starting worker A (with store) and R (reference, no store) …")
        a = started(Worker("a", model, store, index, workdir, pages, ports["a"]))
        r = started(Worker("r", model, None, None, workdir, pages, ports["r"]))
        sid = _call(a.port, "POST", "/v1/sessions", {})["id"]
        rsid = _call(r.port, "POST", "/v1/sessions", {})["id"]
        history: list[int] = []
        for i, text in enumerate(turns[:-1], 1):
            out = a.complete({"prompt": text, "session_id": sid, **gen})
            r.complete({"prompt": text, "session_id": rsid, **gen})
            history = history or [256]  # BOS opens the conversation
            history += list(text.encode()) + out["choices"][0]["token_ids"]
            k = out["kvcloud"]
            console.print(
                f"  turn {i} on A: {out['usage']['prompt_tokens']:,} prompt tokens, "
                f"TTFT {k['ttft_ms']:.0f} ms, session now {k['session_tokens']:,}"
            )
        ref_last = r.complete({"prompt": turns[-1], "session_id": rsid, **gen})
        ref_ids = ref_last["choices"][0]["token_ids"]
        if scrape_wait > 0:
            # SIGTERM would flush too, but after Prometheus's last look at A: flush first so
            # the push shows on the dashboard; the SIGTERM flush then has nothing left to do.
            _call(a.port, "POST", f"/v1/sessions/{sid}/flush", {})
        console.print("stopping worker A with SIGTERM (it flushes the session) …")
        stop(a)
        stop(r)

        console.print("starting worker B (same store) and C (no store) …")
        b = started(Worker("b", model, store, index, workdir, pages, ports["b"]))
        out_b = b.complete({"prompt": turns[-1], "session_id": sid, **gen})
        stop(b)
        c = started(Worker("c", model, None, None, workdir, pages, ports["c"]))
        full = history + list(turns[-1].encode())
        out_c = c.complete({"prompt": full, **gen})
        stop(c)
    finally:
        for w in workers:
            w.stop(signal.SIGKILL)
        if targets is not None:
            targets.close()

    kb, kc = out_b["kvcloud"], out_c["kvcloud"]
    ids_b = out_b["choices"][0]["token_ids"]
    same = ids_b == ref_ids
    speedup = kc["ttft_ms"] / max(kb["ttft_ms"], 1e-6)
    table = Table(title="last turn: session moved from A to B")
    table.add_column("")
    table.add_column("B: restored from kvcloud", justify="right")
    table.add_column("C: recompute, no store", justify="right")
    table.add_row(
        "prompt tokens",
        f"{out_b['usage']['prompt_tokens']:,}",
        f"{out_c['usage']['prompt_tokens']:,}",
    )
    table.add_row("tokens restored", f"{kb['tokens_remote']:,}", f"{kc['tokens_remote']:,}")
    table.add_row("tokens computed", f"{kb['tokens_computed']:,}", f"{kc['tokens_computed']:,}")
    table.add_row("TTFT", f"{kb['ttft_ms']:.0f} ms", f"{kc['ttft_ms']:.0f} ms")
    table.add_row("speedup (TTFT C / B)", f"[b]{speedup:.1f}×[/b]", "1.0×")
    console.print(table)
    verdict = "[green]yes[/green]" if same else "[red]NO[/red]"
    console.print(
        f"B's output equals the uninterrupted run on R: {verdict} ({len(ids_b)} tokens compared)"
    )
    summary = {
        "model": model,
        "store": store.split("?")[0],
        "session_id": sid,
        "b": kb,
        "c": kc,
        "speedup": speedup,
        "identical": same,
        "prompt_tokens": out_b["usage"]["prompt_tokens"],
    }
    (workdir / "demo-result.json").write_text(json.dumps(summary, indent=2))
    console.print(f"details: {workdir / 'demo-result.json'}, worker logs in {workdir}/")
    return 0 if same and kb["tokens_remote"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__)
    p.add_argument("--model", default="small")
    p.add_argument(
        "--chars",
        type=int,
        default=3000,
        help="size of the conversation before the last turn (≈ tokens)",
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dir", type=Path, default=Path(".kvcloud-demo"))
    p.add_argument(
        "--prometheus-sd",
        type=Path,
        metavar="FILE",
        help="keep a Prometheus file_sd_configs JSON list of the demo's workers here while "
        "they run (infra/local/start.sh watches .kvcloud-local/prometheus/targets/*.json)",
    )
    p.add_argument(
        "--scrape-wait",
        type=float,
        help="seconds each worker waits after starting and before stopping, so Prometheus "
        "samples it (default: 5 with --prometheus-sd, else 0)",
    )
    args = p.parse_args(argv)
    wait = args.scrape_wait
    if wait is None:
        wait = 5.0 if args.prometheus_sd else 0.0
    return run(args.model, args.chars, args.max_tokens, args.dir, args.prometheus_sd, wait)


if __name__ == "__main__":
    sys.exit(main())
