"""TTFT on a second vLLM that never saw the prompt: recompute vs kvcloud vs ExampleConnector.

For each prompt length, a fresh prompt is sent to a *pusher* vLLM, then the same prompt to a
*receiver* vLLM (another process, its own empty prefix cache) with ``max_tokens=1``; TTFT is
that request's wall time. Three ways of getting the prefix to the receiver:

- recompute: a vLLM without any connector computes the whole prefill;
- kvcloud: the kvcloud connector, over the embedded default (file:// + sqlite://) and over
  moto_server (S3 over HTTP) + redis-server;
- ExampleConnector: vLLM's own shared-storage connector (one safetensors file per layer per
  prompt in a shared folder), its reference baseline.

Also: the bytes each stores for a chat whose prompt grows turn by turn. Medians of ``--runs``
prompts per length; everything in one run, on one machine. Servers run fp32 eager (see
scripts/vllm_fleet.py). Writes JSON (``--out``) and prints a table.

    python scripts/bench_vllm.py --out docs/bench/vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.vllm_fleet import (
    VLLMServer,
    cached_tokens,
    example_transfer_config,
    kvcloud_transfer_config,
    wait_stored,
)


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(200, 48_000) for _ in range(n)]


def start(*servers: VLLMServer) -> None:
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready(600)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def ttft(server: VLLMServer, tokens: list[int]) -> tuple[float, int]:
    r = server.complete(tokens, max_tokens=1)
    return r["elapsed_s"], cached_tokens(r)


def chat_turns(n_turns: int, seed: int) -> list[list[int]]:
    """Prompts of a chat growing turn by turn: each turn adds ~300 tokens."""
    base = prompt(600, seed)
    out, cur = [], list(base)
    for t in range(n_turns):
        cur = cur + prompt(300, seed * 100 + t)
        out.append(list(cur))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvcloud-bench-vllm-"))
    logs = work / "logs"
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict[str, Any] = {"lengths": lengths, "runs": args.runs, "ttft": {}, "chat": {}}
    seed = 1000

    def measure(label: str, pusher: VLLMServer | None, receiver: VLLMServer, env=None) -> None:
        nonlocal seed
        rows = {}
        for n in lengths:
            times, cached = [], []
            for _ in range(args.runs):
                seed += 1
                p = prompt(n, seed)
                if pusher is not None:
                    pusher.complete(p, max_tokens=1)
                    if env is not None:
                        wait_stored(env, p)
                t, c = ttft(receiver, p)
                times.append(t)
                cached.append(c)
            rows[n] = {"ttft_s": statistics.median(times), "all_s": times, "cached": cached}
            print(
                f"{label:>22} {n:>6} tokens: TTFT {rows[n]['ttft_s'] * 1000:8.0f} ms, "
                f"cached {cached}",
                flush=True,
            )
        results["ttft"][label] = rows

    def chat_bytes(label: str, server: VLLMServer, store_dir: Path) -> None:
        before = dir_bytes(store_dir)
        turns = chat_turns(args.chat_turns, seed=7)
        for p in turns:
            server.complete(p, max_tokens=1)
        time.sleep(2)  # kvcloud's uploader is asynchronous
        results["chat"][label] = {
            "turns": len(turns),
            "final_prompt_tokens": len(turns[-1]),
            "bytes": dir_bytes(store_dir) - before,
        }
        print(
            f"{label}: chat of {len(turns)} turns stored "
            f"{results['chat'][label]['bytes'] / 2**20:.1f} MiB",
            flush=True,
        )

    ref = VLLMServer("R", logs / "R.log")
    # -- kvcloud, embedded default ------------------------------------------------------------
    emb = {
        "KVCLOUD_STORE": f"file://{work}/kvc/objects",
        "KVCLOUD_INDEX": f"sqlite://{work}/kvc/index.db",
        "KVCLOUD_SECRET": "bench",
    }
    cfg = kvcloud_transfer_config()
    k1 = VLLMServer("K1", logs / "K1.log", transfer=cfg, env=emb)
    k2 = VLLMServer("K2", logs / "K2.log", transfer=cfg, env=emb)
    start(ref, k1, k2)
    for n in lengths:  # warm every server's kernels at every length before timing
        for s in (ref, k1, k2):
            s.complete(prompt(n, 1), max_tokens=1)
    measure("recompute", None, ref)
    measure("kvcloud file+sqlite", k1, k2, emb)
    chat_bytes("kvcloud", k1, work / "kvc" / "objects")
    k1.stop()
    k2.stop()
    # -- kvcloud over moto_server + redis-server ------------------------------------------------
    from tests.servers import s3_env, start_moto, start_redis

    moto = start_moto(work / "moto")
    redis = start_redis(work / "redis")
    os.environ.update(s3_env(moto.endpoint))  # this process reads the index too
    srv = {
        **s3_env(moto.endpoint),
        "KVCLOUD_STORE": moto.store_url(prefix="bench") + "&create_bucket=true",
        "KVCLOUD_INDEX": redis.url,
        "KVCLOUD_SECRET": "bench",
    }
    s1 = VLLMServer("S1", logs / "S1.log", transfer=cfg, env=srv)
    s2 = VLLMServer("S2", logs / "S2.log", transfer=cfg, env=srv)
    start(s1, s2)
    for n in lengths:
        for s in (s1, s2):
            s.complete(prompt(n, 2), max_tokens=1)
    measure("kvcloud moto+redis", s1, s2, srv)
    s1.stop()
    s2.stop()
    redis.stop()
    moto.stop()
    # -- vLLM's ExampleConnector --------------------------------------------------------------
    shared = work / "example"
    shared.mkdir()
    x1 = VLLMServer("X1", logs / "X1.log", transfer=example_transfer_config(shared))
    x2 = VLLMServer("X2", logs / "X2.log", transfer=example_transfer_config(shared))
    start(x1, x2)
    for n in lengths:
        for s in (x1, x2):
            s.complete(prompt(n, 3), max_tokens=1)
    measure("ExampleConnector", x1, x2)
    chat_bytes("ExampleConnector", x1, shared)
    x1.stop()
    x2.stop()
    ref.stop()
    shutil.rmtree(work, ignore_errors=True)
    return results


def table(res: dict[str, Any]) -> str:
    lines = [
        "| prompt tokens | recompute | kvcloud file+sqlite | kvcloud moto+redis | "
        "ExampleConnector |",
        "|---:|---:|---:|---:|---:|",
    ]
    rec = res["ttft"]["recompute"]
    for n in res["lengths"]:
        cells = [f"{rec[str(n)]['ttft_s'] * 1000:,.0f} ms"]
        for label in ("kvcloud file+sqlite", "kvcloud moto+redis", "ExampleConnector"):
            row = res["ttft"][label][str(n)]
            ratio = rec[str(n)]["ttft_s"] / row["ttft_s"]
            cells.append(f"{row['ttft_s'] * 1000:,.0f} ms ({ratio:.1f}×)")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chat-turns", type=int, default=6)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = json.loads(json.dumps(run(args)))  # str keys, as read back from the file
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    for label, row in res["chat"].items():
        print(
            f"chat, {row['turns']} turns to {row['final_prompt_tokens']} tokens: {label} "
            f"stored {row['bytes'] / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
