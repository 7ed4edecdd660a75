"""TTFT on a second vLLM that never saw the prompt: recompute vs kvcloud vs ExampleConnector.

For each prompt length, a fresh prompt is sent to a *pusher* vLLM, then the same prompt to a
*receiver* vLLM (another process, its own empty prefix cache) with ``max_tokens=1``; TTFT is
that request's wall time. Three ways of getting the prefix to the receiver:

- recompute: a vLLM without any connector computes the whole prefill;
- kvcloud: the kvcloud connector, over the embedded default (file:// + sqlite://) and over
  moto_server (S3 over HTTP) + redis-server;
- ExampleConnector: vLLM's own shared-storage connector (one safetensors file per layer per
  prompt in a shared folder), its reference baseline.

Each kvcloud setup runs side by side with ExampleConnector (four servers: a pusher and a
receiver each; six do not fit in 24 GiB) and they take turns on the same prompts, in
alternating order: each run sends one fresh prompt through both, so a slow moment of this
shared machine lands on both alike instead of on whichever phase it happened to hit. The
paired ratio (ExampleConnector's TTFT ÷ kvcloud's, same prompt, same minute) is reported
beside the medians. Recompute runs first, on its own server.

Also: the bytes each stores for a chat whose prompt grows turn by turn. Medians of ``--runs``
prompts per length; everything in one run, on one machine. Servers run fp32 eager (see
scripts/fleet/vllm_fleet.py). Writes JSON (``--out``) and prints a table.

    python scripts/bench/bench_vllm.py --out docs/bench/vllm.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.vllm_fleet import (
    VLLMServer,
    cached_tokens,
    example_transfer_config,
    kvcloud_transfer_config,
    wait_stored,
)

PHASES = ("recompute", "compare")
METHODS = ("kvcloud file+sqlite", "kvcloud moto+redis", "ExampleConnector")


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


class Bench:
    """One run: its scratch folder, settings and results (saved after every phase)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="kvcloud-bench-vllm-"))
        self.logs = self.work / "logs"
        self.lengths = [int(x) for x in args.lengths.split(",")]
        self.phases = set(args.phases.split(","))
        self.results: dict[str, Any] = {
            "lengths": self.lengths,
            "runs": args.runs,
            "ttft": {},
            "chat": {},
        }
        if args.out and args.out.exists() and self.phases != set(PHASES):
            self.results = json.loads(args.out.read_text())  # add to a run's other phases
        self.seed = 1000 + 100_000 * len(self.results["ttft"])
        self.cfg = kvcloud_transfer_config()

    def save(self) -> None:
        if self.args.out:  # after every phase, so a failure later keeps what was measured
            self.args.out.parent.mkdir(parents=True, exist_ok=True)
            self.args.out.write_text(json.dumps(self.results, indent=2) + "\n")

    def warm(self, servers: tuple[VLLMServer, ...], salt: int, lengths: list[int]) -> None:
        """Every receiver runs every length once before timing (kernels, allocator); a
        pusher's time is not measured, and its first prompts warm it."""
        for n in lengths:
            for s in servers:
                s.complete(prompt(n, salt + n), max_tokens=1)

    def one(
        self,
        pusher: VLLMServer | None,
        receiver: VLLMServer,
        p: list[int],
        env: dict[str, str] | None,
    ) -> tuple[float, int]:
        if pusher is not None:
            pusher.complete(p, max_tokens=1)
            if env is not None:
                wait_stored(env, p)  # kvcloud's uploader is asynchronous
        # a short unrelated request first: an engine idle for a few seconds (while the
        # pusher worked) answers its next request 0.5–0.8 s late on this machine, whatever
        # that request is; a serving fleet is not idle
        receiver.complete(prompt(16, self.seed + 500_000), max_tokens=1)
        return ttft(receiver, p)

    def record(self, label: str, n: int, times: list[float], cached: list[int]) -> None:
        self.results["ttft"].setdefault(label, {})[str(n)] = {
            "ttft_s": statistics.median(times),
            "all_s": times,
            "cached": cached,
        }
        print(
            f"{label:>22} {n:>6} tokens: TTFT {statistics.median(times) * 1000:8.0f} ms "
            f"(runs {', '.join(f'{t * 1000:.0f}' for t in times)}), cached {cached}",
            flush=True,
        )

    def measure(
        self,
        methods: dict[str, tuple[VLLMServer | None, VLLMServer, dict[str, str] | None]],
    ) -> None:
        """Each run: one fresh prompt through every method, in a rotating order."""
        labels = list(methods)
        for n in self.lengths:
            times: dict[str, list[float]] = {k: [] for k in labels}
            cached: dict[str, list[int]] = {k: [] for k in labels}
            for run in range(self.args.runs):
                self.seed += 1
                p = prompt(n, self.seed)
                for label in labels[run % len(labels) :] + labels[: run % len(labels)]:
                    t, c = self.one(*methods[label][:2], p, methods[label][2])
                    times[label].append(t)
                    cached[label].append(c)
            for label in labels:
                old = self.results["ttft"].get(label, {}).get(str(n))
                if label == METHODS[2] and old is not None and len(labels) > 1:
                    # ExampleConnector ran beside each kvcloud setup: pool its runs
                    times[label] = old["all_s"] + times[label]
                    cached[label] = old["cached"] + cached[label]
                self.record(label, n, times[label], cached[label])
            if METHODS[2] in labels and len(labels) == 2:
                mine = next(k for k in labels if k != METHODS[2])
                x = times[METHODS[2]][-self.args.runs :]
                ratios = [a / b for a, b in zip(x, times[mine], strict=True)]
                self.results.setdefault("paired", {}).setdefault(mine, {})[str(n)] = {
                    "ratios": ratios,
                    "median": statistics.median(ratios),
                }
                print(
                    f"{'':>22} {n:>6} tokens: ExampleConnector ÷ {mine}, same prompts: "
                    f"median {statistics.median(ratios):.2f} "
                    f"({', '.join(f'{r:.2f}' for r in ratios)})",
                    flush=True,
                )
            self.save()

    def chat_bytes(self, label: str, server: VLLMServer, store_dir: Path) -> None:
        before = dir_bytes(store_dir)
        turns = chat_turns(self.args.chat_turns, seed=7)
        for p in turns:
            server.complete(p, max_tokens=1)
        time.sleep(2)  # kvcloud's uploader is asynchronous
        row = {
            "turns": len(turns),
            "final_prompt_tokens": len(turns[-1]),
            "bytes": dir_bytes(store_dir) - before,
        }
        self.results["chat"][label] = row
        self.save()
        print(f"{label}: chat of {len(turns)} turns stored {row['bytes'] / 2**20:.1f} MiB")

    def recompute(self) -> None:
        """A vLLM without any connector computes the whole prefill."""
        ref = VLLMServer("R", self.logs / "R.log")
        start(ref)
        try:
            self.warm((ref,), 10_000, self.lengths)
            self.measure({"recompute": (None, ref, None)})
        finally:
            ref.stop()

    def compare(self) -> None:
        """kvcloud over file:// + sqlite://, then over moto_server + redis-server, each side
        by side with vLLM's ExampleConnector.

        ExampleConnector names its files by the whole prompt but saves what one engine step
        computed: a prompt prefilled in several steps (chunked prefill, 2,048 tokens a step
        by default here) is saved short, and loading it kills the engine ("shape mismatch:
        value tensor of shape [2048, 3, 128] cannot be broadcast to indexing result of shape
        [3968, 3, 128]", seen at 4,096 tokens). Its servers therefore prefill up to 8,192
        tokens in one step; the receiver computes less than a block either way.
        """
        from tests.servers import s3_env, start_moto, start_redis

        file_env = {
            "KVCLOUD_STORE": f"file://{self.work}/kvc/objects",
            "KVCLOUD_INDEX": f"sqlite://{self.work}/kvc/index.db",
            "KVCLOUD_SECRET": "bench",
        }
        moto = start_moto(self.work / "moto")
        redis = start_redis(self.work / "redis")
        os.environ.update(s3_env(moto.endpoint))  # this process reads the index too
        s3 = {
            **s3_env(moto.endpoint),
            "KVCLOUD_STORE": moto.store_url(prefix="bench") + "&create_bucket=true",
            "KVCLOUD_INDEX": redis.url,
            "KVCLOUD_SECRET": "bench",
        }
        shared = self.work / "example"
        shared.mkdir()
        one_step = ["--max-num-batched-tokens", "8192"]
        xcfg = example_transfer_config(shared)
        x1 = VLLMServer("X1", self.logs / "X1.log", transfer=xcfg, args=one_step)
        x2 = VLLMServer("X2", self.logs / "X2.log", transfer=xcfg, args=one_step)
        k1 = VLLMServer("K1", self.logs / "K1.log", transfer=self.cfg, env=file_env)
        k2 = VLLMServer("K2", self.logs / "K2.log", transfer=self.cfg, env=file_env)
        s1 = VLLMServer("S1", self.logs / "S1.log", transfer=self.cfg, env=s3)
        s2 = VLLMServer("S2", self.logs / "S2.log", transfer=self.cfg, env=s3)
        example = (x1, x2, None)
        # ExampleConnector's runs are pooled over this phase's two windows only
        self.results["ttft"].pop(METHODS[2], None)
        self.results.pop("paired", None)
        try:
            start(x1, x2, k1, k2)
            self.warm((x2, k2), 20_000, self.lengths)
            self.measure({METHODS[0]: (k1, k2, file_env), METHODS[2]: example})
            self.chat_bytes("kvcloud", k1, self.work / "kvc" / "objects")
            for s in (k1, k2):
                s.stop()
            start(s1, s2)
            self.warm((s2,), 30_000, self.lengths)
            self.measure({METHODS[1]: (s1, s2, s3), METHODS[2]: example})
            self.chat_bytes("ExampleConnector", x1, shared)
        finally:
            for s in (x1, x2, k1, k2, s1, s2):
                s.stop()
            redis.stop()
            moto.stop()

    def run(self) -> dict[str, Any]:
        for phase in PHASES:
            if phase in self.phases:
                getattr(self, phase)()
        shutil.rmtree(self.work, ignore_errors=True)
        return self.results


def table(res: dict[str, Any]) -> str:
    lines = [
        "| prompt tokens | recompute | kvcloud file+sqlite | kvcloud moto+redis | "
        "ExampleConnector |",
        "|---:|---:|---:|---:|---:|",
    ]
    rec = res["ttft"].get("recompute", {})
    for n in res["lengths"]:
        base = rec.get(str(n), {}).get("ttft_s")
        cells = [f"{base * 1000:,.0f} ms" if base else "—"]
        for label in METHODS:
            row = res["ttft"].get(label, {}).get(str(n))
            if row is None:
                cells.append("—")
                continue
            ratio = f" ({base / row['ttft_s']:.1f}×)" if base else ""
            cells.append(f"{row['ttft_s'] * 1000:,.0f} ms{ratio}")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(res: dict[str, Any]) -> str:
    paired = res.get("paired", {})
    lines = ["| prompt tokens | " + " | ".join(paired) + " |", "|---:|" + "---:|" * len(paired)]
    for n in res["lengths"]:
        cells = [
            f"{paired[m][str(n)]['median']:.2f}×" if str(n) in paired[m] else "—" for m in paired
        ]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(res: dict[str, Any]) -> str:
    lines = [
        f"TTFT (median of {res['runs']}) on a vLLM that never saw the prompt; in brackets, "
        "recompute ÷ it:",
        "",
        table(res),
        "",
        "ExampleConnector's TTFT ÷ kvcloud's on the same prompts, in the same minutes (median "
        "of the paired runs; above 1 means kvcloud restored faster):",
        "",
        paired_table(res),
        "",
        "| stored by a chat growing turn by turn | turns | last prompt | bytes |",
        "|---|---:|---:|---:|",
    ]
    for label, row in res["chat"].items():
        lines.append(
            f"| {label} | {row['turns']} | {row['final_prompt_tokens']:,} tokens "
            f"| {row['bytes'] / 2**20:,.1f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8000")
    # even, so that in each pair each method goes first equally often
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--chat-turns", type=int, default=6)
    ap.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="recompute (no connector), compare (kvcloud file+sqlite, kvcloud moto+redis and "
        "ExampleConnector side by side); a subset adds to the results already in --out",
    )
    ap.add_argument("--out", type=Path, help="JSON results; a .md of the tables beside it")
    ap.add_argument("--from-json", type=Path, help="only print the tables of a saved run")
    args = ap.parse_args()
    res = json.loads(args.from_json.read_text()) if args.from_json else Bench(args).run()
    text = report(res)
    if args.out:
        args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
