"""What the connector's uploader does to a decoding engine on the same core, in and out of
its process.

Each server in ``make bench-vllm-load`` is bound to one core; its forward pass, and the
connector's uploader thread (encode, BLAKE3, encrypt, write: ``KVCloud.push_chunks``), share
it. A forward-like loop (per layer a few small torch ops with Python between them, as a
decode step) is timed per step on one core: alone, beside the same pushes made by a thread
of its own process (the two share the core and the GIL), the same thread at nice 10 and 19
(``upload_nice``: the connector's default is 19), and beside the same pushes made by another
process bound to the same core (they share only the core). The
chunks are SmolLM2-135M's shape in fp32 (128 tokens, 5.9 MB), encrypted, to a ``file://``
store, as in the load bench.

    python scripts/bench/bench_vllm_upload_interference.py --seconds 8

``--hog`` runs every case again with a busy process at nice 0 bound to the same core: what
the other vLLM server of a pair (or any busy neighbour) is to this one. Then a low-priority
uploader thread that holds the GIL when the kernel preempts it for the neighbour keeps the
forward thread waiting until the kernel runs it again (a priority inversion through the
GIL, which a nice value cannot see).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from kvcloud import KVCloud, Namespace
from kvcloud.integrations.vllm.uploader import lower_priority

LAYERS, HEADS, DIM, BLOCK = 30, 3, 64, 128  # SmolLM2-135M, the bench's block size


def pusher(
    work: str, core: int, stop: threading.Event | None, seconds: float, nice: int = 0
) -> None:
    """Push fresh chunks back to back until told to stop (or for ``seconds``), at ``nice``."""
    os.sched_setaffinity(0, {core})
    lower_priority(nice)  # as the connector's uploader does: this thread only
    ns = Namespace(
        model="bench", revision="r", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
        dtype="float32", chunk_tokens=BLOCK,
    )  # fmt: skip
    kvc = KVCloud.open(store=f"file://{work}/o", index=f"sqlite://{work}/i.db", secret="b")
    rng = np.random.default_rng(os.getpid())
    kv = rng.standard_normal(ns.kv_shape(BLOCK), dtype=np.float32)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        fp = rng.bytes(32)
        kvc.push_chunks(ns, [(fp, b"\0" * 32, kv)])
        n += 1
    kvc.close()
    print(f"  pushed {n} chunks ({n * kv.nbytes / 1e6:.0f} MB)", flush=True)


def hog(core: int, seconds: float) -> None:
    """A busy neighbour at nice 0 on ``core``: pure Python, never idle."""
    os.sched_setaffinity(0, {core})
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1


def steps_ms(seconds: float) -> list[float]:
    """Time a decode-like step (30 layers of small ops) over and over for ``seconds``."""
    x, w = torch.randn(3, 576), torch.randn(576, 576)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            y = torch.nn.functional.silu(x @ w)
            x = (y * 0.5 + x) / (x.norm() + 1)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument(
        "--hog", action="store_true", help="also run each case beside a busy process on the core"
    )
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="kvcloud-upint-")
    results: dict[str, list[float]] = {}
    if args.hog:
        results.update(beside_a_neighbour(work, args.core, args.seconds))

    results["alone"] = steps_ms(args.seconds)

    for nice, name in (
        (0, "uploader thread, same process"),
        (10, "uploader thread at nice 10"),
        (19, "uploader thread at nice 19"),
    ):
        stop = threading.Event()
        th = threading.Thread(
            target=pusher, args=(work, args.core, stop, 3600.0, nice), daemon=True
        )
        th.start()
        time.sleep(0.5)
        results[name] = steps_ms(args.seconds)
        stop.set()
        th.join()

    proc = mp.get_context("spawn").Process(
        target=pusher, args=(work, args.core, None, args.seconds + 1.0)
    )
    proc.start()
    time.sleep(0.5)
    results["uploader in another process, same core"] = steps_ms(args.seconds)
    proc.join()

    print(f"\ndecode-like step ({LAYERS} layers of small ops), one core, {args.seconds:.0f} s each")
    print(
        "\n| beside | steps | p50 ms | p90 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, t in results.items():
        s = sorted(t)
        p90, p99 = s[int(0.9 * (len(s) - 1))], s[int(0.99 * (len(s) - 1))]
        print(
            f"| {name} | {len(s)} | {statistics.median(s):.2f} | {p90:.2f} | {p99:.2f} "
            f"| {s[-1]:.2f} |"
        )


def beside_a_neighbour(work: str, core: int, seconds: float) -> dict[str, list[float]]:
    """The cases with a busy process on the core: alone, and with the uploader thread at
    nice 0 and 19."""
    out: dict[str, list[float]] = {}
    ctx = mp.get_context("spawn")
    for nice in (None, 0, 19):
        neighbour = ctx.Process(target=hog, args=(core, seconds + 1.5))
        neighbour.start()
        stop = threading.Event()
        th = None
        if nice is not None:
            th = threading.Thread(target=pusher, args=(work, core, stop, 3600.0, nice), daemon=True)
            th.start()
        time.sleep(0.5)
        name = "busy neighbour" if nice is None else f"busy neighbour + uploader at nice {nice}"
        out[name] = steps_ms(seconds)
        stop.set()
        if th is not None:
            th.join()
        neighbour.join()
    return out


if __name__ == "__main__":
    main()
