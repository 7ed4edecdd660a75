"""``kvcloud bench store``: kvcloud's push, pull and lookup next to a plain client, in one run.

Every figure is measured against a baseline that moves the same bytes to the same store with
the same concurrency, in the same process and the same run (DESIGN §9: ratios, never absolute
times alone):

- push: ``KVCloud.push_chunks`` of N fresh chunks vs plain ``put_object`` (or ``open().write``
  for ``file://``) of the very bytes kvcloud stores, to fresh keys;
- pull: ``lookup`` + ``pull_into`` (verification included) of those N chunks into
  preallocated pages, the worker's restore path, and ``lookup`` + ``pull(out=…)`` into one
  preallocated ``[layers, 2, tokens, …]`` array (each chunk lands strided), vs plain parallel
  ``get_object()['Body'].read()`` (or ``open().read``) of the same objects;
- lookup: latency of a ``lookup_chunks``-chunk prompt (all hits) vs one ``index.ping()``;
- with ``encrypt``: the same push and pulls for a tenant that encrypts at rest (AES-256-GCM),
  in the same rounds, next to the unencrypted kvcloud figures — the overhead ratio.

The bench writes only under a namespace of its own (``model="kvcloud-bench"``, a random
revision per run), so it can run against a production deployment and clean up exactly what it
wrote. ``run_store_bench`` is the entry point for Python callers (the worker bench, the docs
generator); ``kvcloud bench store`` in cli.py is a thin wrapper around it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .client import KVCloud
from .config import KVCloudConfig
from .crypto import ALG
from .errors import KVCloudError
from .indexes.base import Index, IndexEntry
from .models import KV_SHAPES
from .namespace import Namespace
from .segment import content_digest, encode_segment, object_key
from .stores.base import ObjectStore
from .stores.file import FileStore
from .stores.s3 import S3Store
from .urls import redact_url

BENCH_MODEL = "kvcloud-bench"  # namespace model of everything the bench writes
BENCH_ENC_TENANT = "kvcloud-bench-encrypted"  # the bench's encrypting tenant (--encrypt)
JSON_VERSION = 1

Progress = Callable[[str], None]


class BenchError(KVCloudError):
    """The bench cannot run as asked (missing server binaries, a store without a baseline)."""


# --- layout -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchLayout:
    """The KV geometry of the segments the bench moves."""

    model: str  # the preset it came from, or "custom"
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int

    @classmethod
    def resolve(
        cls,
        model: str | None = "small",
        *,
        layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: str | None = None,
        chunk_tokens: int = 256,
    ) -> BenchLayout:
        """A preset, with any explicitly given dimension overriding it."""
        if model:
            shape = KV_SHAPES.get(model)
            if shape is None:
                raise BenchError(f"unknown model {model!r}; known: {', '.join(KV_SHAPES)}")
            base = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
        else:
            base = (0, 0, 0, "float16")
        given = (layers, kv_heads, head_dim, dtype)
        values = tuple(g if g is not None else b for g, b in zip(given, base, strict=True))
        name = model if model and all(g is None for g in given) else "custom"
        if not model and not all(given[:3]):
            raise BenchError("without --model, give --layers, --kv-heads and --head-dim")
        return cls(name, *values, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]

    def namespace(self, run_id: str) -> Namespace:
        # A fresh revision per run: the bench never shares a namespace (hence an object or
        # an entry) with real data or with another bench run, and cleanup can sweep it whole.
        return Namespace(
            model=BENCH_MODEL,
            revision=run_id,
            num_layers=self.layers,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            chunk_tokens=self.chunk_tokens,
        )


# --- local servers (--servers) ------------------------------------------------------------------


def find_server_binaries() -> tuple[str, str]:
    """(moto_server, redis-server) paths, or a BenchError naming what to install."""
    # moto_server lives in the venv's bin/, which need not be on PATH (``.venv/bin/kvcloud``)
    beside = Path(sys.executable).with_name("moto_server")
    moto = str(beside) if os.access(beside, os.X_OK) else shutil.which("moto_server")
    redis = shutil.which("redis-server")
    missing = []
    if moto is None:
        missing.append("moto_server (pip install 'moto[server]')")
    if redis is None:
        missing.append("redis-server (apt-get install -y redis-server, or brew install redis)")
    if missing:
        raise BenchError("--servers needs " + " and ".join(missing) + " on PATH")
    assert moto is not None and redis is not None
    return moto, redis


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], port: int, log_path: Path, timeout: float = 30.0) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        # A session of its own: Ctrl-C reaches only us, and our cleanup stops the server.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise BenchError(f"{argv[0]} exited with {proc.returncode}:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.05)
    _stop(proc)
    raise BenchError(f"{argv[0]} did not listen on port {port} within {timeout:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def _env(values: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def local_servers() -> Iterator[tuple[str, str]]:
    """Start moto_server and redis-server on free ports in a temp dir; yield (store, index).

    Dummy AWS credentials are set for the duration (moto accepts any), so the user's real
    ones are never sent anywhere, not even to a local server.
    """
    moto_bin, redis_bin = find_server_binaries()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcloud-bench-")))
        moto_port, redis_port = _free_port(), _free_port()
        moto = _start(
            [moto_bin, "-H", "127.0.0.1", "-p", str(moto_port)], moto_port, workdir / "moto.log"
        )
        stack.callback(_stop, moto)
        redis = _start(
            [
                redis_bin,
                *("--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(workdir)),
                *("--save", "", "--appendonly", "no", "--daemonize", "no"),
            ],
            redis_port,
            workdir / "redis.log",
        )
        stack.callback(_stop, redis)
        stack.enter_context(
            _env(
                {
                    "AWS_ACCESS_KEY_ID": "kvcloud-bench",
                    "AWS_SECRET_ACCESS_KEY": "kvcloud-bench",
                    "AWS_SESSION_TOKEN": None,
                    "AWS_PROFILE": None,
                }
            )
        )
        store = (
            f"s3://kvcloud-bench/segments?endpoint_url=http://127.0.0.1:{moto_port}"
            "&region=us-east-1&create_bucket=true"
        )
        yield store, f"redis://127.0.0.1:{redis_port}/0"


# --- baselines ----------------------------------------------------------------------------------


class _Plain:
    """What a user writes by hand: put/get whole objects by key, nothing else."""

    method_put = ""
    method_get = ""

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def prepare(self, keys: Sequence[str]) -> None:
        """Anything a plain client would have done before the transfer (mkdir)."""

    def close(self) -> None:
        pass


class _PlainS3(_Plain):
    method_put = "boto3 put_object"
    method_get = "boto3 get_object"

    def __init__(self, store: S3Store) -> None:
        import boto3
        from botocore.config import Config

        cfg = store.config
        self.bucket = cfg.bucket
        self.prefix = f"{cfg.prefix}/" if cfg.prefix else ""
        # The same endpoint, region, addressing, pool size and checksum policy as kvcloud's
        # client, so the comparison is about kvcloud's own work and not client settings.
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            region_name=cfg.region,
            config=Config(
                region_name=cfg.region,
                s3={"addressing_style": cfg.addressing_style},
                max_pool_connections=int(cfg.max_connections),
                connect_timeout=float(cfg.connect_timeout),
                read_timeout=float(cfg.read_timeout),
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def close(self) -> None:
        self.client.close()


class _PlainFile(_Plain):
    method_put = "file open().write"
    method_get = "file open().read"

    def __init__(self, store: FileStore) -> None:
        self.root = store.root

    def prepare(self, keys: Sequence[str]) -> None:
        for d in {(self.root / k).parent for k in keys}:
            d.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, data: bytes) -> None:
        with open(self.root / key, "wb") as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        with open(self.root / key, "rb") as f:
            return f.read()


def _plain_client(store: ObjectStore) -> _Plain:
    if isinstance(store, S3Store):
        return _PlainS3(store)
    if isinstance(store, FileStore):
        return _PlainFile(store)
    raise BenchError(f"no plain baseline for a {type(store).__name__}; use s3:// or file://")


# --- measurement helpers ------------------------------------------------------------------------


def _throughput(nbytes: int, seconds: Sequence[float]) -> dict[str, Any]:
    best, median = min(seconds), statistics.median(seconds)
    return {
        "seconds": list(seconds),
        "gbps_best": nbytes / best / 1e9,
        "gbps_median": nbytes / median / 1e9,
    }


def _pair(kvcloud: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    return {
        "kvcloud": kvcloud,
        "baseline": baseline,
        "ratio_best": kvcloud["gbps_best"] / baseline["gbps_best"],
        "ratio_median": kvcloud["gbps_median"] / baseline["gbps_median"],
    }


def _latency(samples_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
    }


def _random_chunks(ns: Namespace, n: int, seed: int | None) -> list[np.ndarray]:
    """n contiguous chunks (like worker pages) of random bits viewed as the cache dtype."""
    rng = np.random.default_rng(seed)
    storage = np.dtype(ns.dtype_info.storage)
    raw = rng.integers(0, 256, size=(n, ns.chunk_bytes), dtype=np.uint8)
    return [raw[i].view(storage).reshape(ns.kv_shape(ns.chunk_tokens)) for i in range(n)]


def _fresh_chain(ns: Namespace, n: int) -> list[tuple[bytes, bytes]]:
    """n (fp, parent) pairs chained from the namespace digest; random, so never seen before."""
    fps = [secrets.token_bytes(32) for _ in range(n)]
    return list(zip(fps, [ns.digest, *fps[:-1]], strict=True))


@dataclass
class _Round:
    push_kvcloud: float
    push_plain: float
    # one time per pull pass
    pull_kvcloud: list[float]
    pull_array: list[float]
    pull_plain: list[float]
    nbytes: int
    objects_deleted: int = 0
    entries_dropped: int = 0
    # --encrypt: the same chunks for a tenant that encrypts (0.0 / empty when not measured)
    push_encrypted: float = 0.0
    pull_encrypted: list[float] = field(default_factory=list)
    pull_array_encrypted: list[float] = field(default_factory=list)
    nbytes_encrypted: int = 0

    def times(self, attr: str) -> list[float]:
        value = getattr(self, attr)
        return list(value) if isinstance(value, list) else [value]


# --- the bench ----------------------------------------------------------------------------------


def run_store_bench(
    store: str | None = None,
    index: str | None = None,
    *,
    servers: bool = False,
    layout: BenchLayout | None = None,
    chunks: int = 64,
    concurrency: int | None = None,
    repeat: int = 3,
    pull_passes: int = 3,
    lookup_chunks: int = 128,
    lookup_iters: int = 2000,
    codec: str | None = None,
    keep: bool = False,
    seed: int | None = None,
    progress: Progress | None = None,
    encrypt: bool = False,
) -> dict[str, Any]:
    """Measure push, pull and lookup of kvcloud next to a plain client; return the figures.
    ``encrypt`` adds the same push and pulls for an encrypting tenant, in the same rounds.

    ``store``/``index`` default to KVCLOUD_STORE/KVCLOUD_INDEX; ``servers=True`` starts a
    local moto_server and redis-server for the run instead. ``concurrency`` defaults to
    KVCloudConfig.max_connections; a ``max_connections`` in an s3:// URL wins, and the
    baseline always uses whatever the store really got.
    """
    if min(chunks, repeat, pull_passes, lookup_chunks, lookup_iters) < 1:
        raise BenchError(
            "chunks, repeat, pull-passes, lookup-chunks and lookup-iters must be at least 1"
        )
    if servers and (store or index):
        raise BenchError("--servers starts its own store and index; drop --store/--index")
    layout = layout or BenchLayout.resolve("small")
    say = progress or (lambda _msg: None)
    with ExitStack() as stack:
        if servers:
            say("starting moto_server and redis-server")
            store, index = stack.enter_context(local_servers())
        result = _run(
            store,
            index,
            servers=servers,
            layout=layout,
            chunks=chunks,
            concurrency=concurrency,
            repeat=repeat,
            pull_passes=pull_passes,
            lookup_chunks=lookup_chunks,
            lookup_iters=lookup_iters,
            codec=codec,
            keep=keep,
            seed=seed,
            say=say,
            encrypt=encrypt,
        )
    return result


def _run(
    store: str | None,
    index: str | None,
    *,
    servers: bool,
    layout: BenchLayout,
    chunks: int,
    concurrency: int | None,
    repeat: int,
    pull_passes: int,
    lookup_chunks: int,
    lookup_iters: int,
    codec: str | None,
    keep: bool,
    seed: int | None,
    say: Progress,
    encrypt: bool = False,
) -> dict[str, Any]:
    started = time.time()
    run_id = secrets.token_hex(8)
    ns = layout.namespace(run_id)
    env_cfg = KVCloudConfig.from_env(store=store, index=index, codec=codec)
    requested = concurrency or env_cfg.max_connections
    # The bench never derives fingerprints from the secret (they are random), so a random
    # one keeps the client quiet about the development secret without touching real keys.
    kv = KVCloud.open(
        store=env_cfg.store,
        index=env_cfg.index,
        secret=secrets.token_bytes(32),
        codec=env_cfg.codec,
        max_connections=requested,
        # only the bench's own tenant: whatever KVCLOUD_ENCRYPT_TENANTS says must not turn
        # the unencrypted figures into encrypted ones
        encrypt_tenants=BENCH_ENC_TENANT if encrypt else "",
    )
    plain: _Plain | None = None
    pool: ThreadPoolExecutor | None = None
    cleanup: dict[str, Any] = {"kept": keep}
    done: list[_Round] = []  # every round run, warm-up included, for the cleanup counts
    try:
        plain = _plain_client(kv.store)
        workers = kv.store.max_workers  # what the store really got (an s3 URL may override)
        if workers != requested:
            say(f"the store URL sets {workers} connections; using {workers}, not {requested}")
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcloud-bench")
        say(f"generating {chunks} chunks of {ns.chunk_bytes:,} bytes")
        data = _random_chunks(ns, chunks, seed)
        # Destinations of the pulls, allocated and touched once, off the clock: pages like
        # the worker's cache, and one token-major array like pull(out=...) callers use.
        storage = ns.dtype_info.storage
        # np.zeros alone would not touch them (calloc maps zero pages lazily), and the first
        # pull into each would pay the page faults: 200 ms of a 250 ms pull here.
        pages = np.empty((chunks, *ns.kv_shape(ns.chunk_tokens)), dtype=storage)
        out = np.empty(ns.kv_shape(chunks * ns.chunk_tokens), dtype=storage)
        pages.fill(0)
        out.fill(0)

        # Warm-up: opens every pooled connection, starts every thread, creates the bucket
        # prefix and directories; not recorded.
        warm = min(chunks, 2 * workers)
        say(f"warm-up round ({warm} chunks)")
        done.append(
            _round(
                kv,
                ns,
                plain,
                pool,
                data[:warm],
                pages,
                out,
                "warmup",
                kvcloud_first=True,
                keep=keep,
                encrypt=encrypt,
            )
        )
        rounds: list[_Round] = []
        for r in range(repeat):
            say(f"round {r + 1}/{repeat}: push and pull {chunks} chunks, kvcloud and plain")
            # alternate who goes first, so neither side always meets the warmer server
            rounds.append(
                _round(
                    kv,
                    ns,
                    plain,
                    pool,
                    data,
                    pages,
                    out,
                    f"r{r}",
                    kvcloud_first=r % 2 == 0,
                    keep=keep,
                    encrypt=encrypt,
                    pull_passes=pull_passes,
                )
            )
            done.append(rounds[-1])
        nbytes = rounds[0].nbytes

        def times(attr: str) -> list[float]:
            return [t for x in rounds for t in x.times(attr)]

        push = _pair(
            _throughput(nbytes, times("push_kvcloud")),
            _throughput(nbytes, times("push_plain")),
        )
        pull = _pair(
            _throughput(nbytes, times("pull_kvcloud")),
            _throughput(nbytes, times("pull_plain")),
        )
        pull_array = _pair(
            _throughput(nbytes, times("pull_array")),
            pull["baseline"],
        )
        push["kvcloud"]["method"] = "KVCloud.push_chunks"
        push["baseline"]["method"] = plain.method_put
        pull["kvcloud"]["method"] = "KVCloud.lookup_fingerprints + pull_into pages (verified)"
        pull["baseline"]["method"] = plain.method_get
        pull_array["kvcloud"]["method"] = "KVCloud.lookup_fingerprints + pull(out=array)"

        encryption: dict[str, Any] | None = None
        if encrypt:
            # Throughput over the same bytes as the unencrypted figures (the plain objects),
            # so each ratio is exactly unencrypted time / encrypted time for the same KV.
            encryption = {
                "alg": ALG,
                "tenant": BENCH_ENC_TENANT,
                "object_bytes": rounds[0].nbytes_encrypted // chunks,
            }
            for op, attr, plain_pair in (
                ("push", "push_encrypted", push),
                ("pull", "pull_encrypted", pull),
                ("pull_array", "pull_array_encrypted", pull_array),
            ):
                figures = _throughput(nbytes, times(attr))
                figures["method"] = f"{plain_pair['kvcloud']['method']}, encrypted"
                # the overhead: encrypted vs unencrypted kvcloud, same run, same rounds
                encryption[op] = _pair(figures, plain_pair["kvcloud"])
                encryption[f"{op}_vs_baseline"] = _pair(figures, plain_pair["baseline"])
                encryption[f"{op}_overhead_pct"] = (1 / encryption[op]["ratio_median"] - 1) * 100

        say(f"index lookup: {lookup_chunks}-chunk prompt × {lookup_iters} vs ping")
        lookup = _lookup_bench(kv, ns, lookup_chunks, lookup_iters)
        memory = None
        if servers:
            say("index memory: 100,000 entries")
            # a namespace of its own: _clean need not drop them one by one (the server goes)
            memory = _index_memory_bench(kv.index, f"{ns.id}-memory", 100_000)

        result: dict[str, Any] = {
            "bench": "store",
            "version": JSON_VERSION,
            "started": datetime.fromtimestamp(started, UTC).isoformat(),
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "machine": platform.machine(),
                "python": platform.python_version(),
                "kvcloud": __version__,
                "numpy": np.__version__,
            },
            "store": redact_url(kv.store.url),
            "index": redact_url(kv.index.url),
            "servers": servers,
            "namespace": ns.id,
            "layout": {
                **asdict(layout),
                "codec": env_cfg.codec,
                "chunk_bytes": ns.chunk_bytes,  # raw KV bytes of one chunk
                "object_bytes": nbytes // chunks,  # encoded segment, header included
            },
            "chunks": chunks,
            "bytes": nbytes,
            "concurrency": workers,
            "repeat": repeat,
            "pull_passes": pull_passes,
            "warmup_chunks": warm,
            "push": push,
            "pull": pull,
            "pull_array": pull_array,
            "lookup": lookup,
        }
        if memory is not None:
            result["index_memory"] = memory
        if encryption is not None:
            result["encryption"] = encryption
    finally:
        run_failed = sys.exc_info()[0] is not None
        try:
            if pool is not None:
                pool.shutdown(wait=True)
            if plain is not None:
                plain.close()
            if not keep:
                say("cleaning up")
                try:
                    swept = _clean(kv, ns)
                except (KVCloudError, OSError) as exc:
                    # Reported, not raised: it must not hide the error that got us here
                    # (often the same outage), and the namespace is unique, so nothing real
                    # is affected by leftovers. When the run already failed the cause is
                    # the error about to be printed; repeating it would bury that one line.
                    if not run_failed:
                        say(f"cleanup of namespace {ns.id} failed: {exc}")
                    else:
                        say(f"cleanup skipped (namespace {ns.id} may hold leftovers)")
                    cleanup["error"] = str(exc)
                    swept = {"objects_deleted": 0, "entries_dropped": 0}
                cleanup["objects_deleted"] = swept["objects_deleted"] + sum(
                    x.objects_deleted for x in done
                )
                cleanup["entries_dropped"] = swept["entries_dropped"] + sum(
                    x.entries_dropped for x in done
                )
        finally:
            kv.close()
    result["cleanup"] = cleanup
    result["elapsed_s"] = time.time() - started
    return result


def _round(
    kv: KVCloud,
    ns: Namespace,
    plain: _Plain,
    pool: ThreadPoolExecutor,
    data: Sequence[np.ndarray],
    pages: np.ndarray,
    out: np.ndarray,
    tag: str,
    *,
    kvcloud_first: bool,
    keep: bool,
    encrypt: bool = False,
    pull_passes: int = 1,
) -> _Round:
    """One push + pull of ``data`` by kvcloud and by the plain client, same bytes (and, with
    ``encrypt``, by kvcloud for an encrypting tenant, under fresh fingerprints). The pulls
    run ``pull_passes`` times, the order rotating each pass so that every method takes every
    place in it once per len(methods) passes."""
    n = len(data)
    chain = _fresh_chain(ns, n)
    items = [(fp, parent, kv_) for (fp, parent), kv_ in zip(chain, data, strict=True)]
    # The exact bytes kvcloud will store (encoding is deterministic), prepared off the clock:
    # the plain client starts from bytes, kvcloud from the arrays — that difference is
    # kvcloud's own cost, which is what the ratio shows.
    segments = [encode_segment(ns, fp, p, a, codec=kv.config.codec) for fp, p, a in items]
    encoded = [bytes(seg.data) for seg in segments]
    kv_keys = [seg.key() for seg in segments]
    del segments
    nbytes = sum(len(b) for b in encoded)
    plain_keys = [f"{ns.id}/plain/{tag}/{i:06d}" for i in range(n)]
    plain.prepare(plain_keys)

    def push_kvcloud() -> float:
        t0 = time.perf_counter()
        res = kv.push_chunks(ns, items)
        dt = time.perf_counter() - t0
        if res.objects_written != n or res.bytes_written != nbytes:
            raise BenchError(
                f"kvcloud wrote {res.objects_written} of {n} objects "
                f"({res.bytes_written} of {nbytes} bytes): the keys were not fresh"
            )
        return dt

    def push_plain() -> float:
        t0 = time.perf_counter()
        list(pool.map(plain.put, plain_keys, encoded))
        return time.perf_counter() - t0

    # encrypted: the same arrays under a chain of their own (so every object is fresh)
    enc_chain = _fresh_chain(ns, n) if encrypt else []
    enc_items = [(fp, parent, kv_) for (fp, parent), kv_ in zip(enc_chain, data, strict=False)]
    enc_fps = [fp for fp, _ in enc_chain]
    enc_keys: list[str] = []
    nbytes_enc = 0
    if encrypt:
        dkey = kv.data_key(BENCH_ENC_TENANT)
        for fp, p, a in enc_items:  # off the clock, like the plain client's bytes
            seg = encode_segment(ns, fp, p, a, codec=kv.config.codec, key=dkey)
            enc_keys.append(seg.key())
            nbytes_enc += len(seg.data)
            del seg

    def push_encrypted() -> float:
        t0 = time.perf_counter()
        res = kv.push_chunks(ns, enc_items, tenant=BENCH_ENC_TENANT)
        dt = time.perf_counter() - t0
        if res.objects_written != n or res.keys != enc_keys:
            raise BenchError("kvcloud did not store the encrypted chunks as expected")
        return dt

    push_order = [push_kvcloud, *([push_encrypted] if encrypt else []), push_plain]
    pushed = {f.__name__: f() for f in (push_order if kvcloud_first else push_order[::-1])}
    t_push_kv, t_push_plain = pushed["push_kvcloud"], pushed["push_plain"]

    fps = [fp for fp, _ in chain]
    c = ns.chunk_tokens

    def _check_pull(got: int, failures: list[Any], keys: list[str]) -> None:
        if got != n:
            raise BenchError(f"kvcloud pulled {got} of {n} chunks: {failures[:3]}")
        if keys != kv_keys:
            raise BenchError("kvcloud stored the chunks under unexpected keys")

    def pull_kvcloud() -> float:
        # the worker's restore path: one contiguous page per chunk
        t0 = time.perf_counter()
        m = kv.lookup_fingerprints(ns, fps)
        res = kv.pull_into(m, pages[:n])
        dt = time.perf_counter() - t0
        _check_pull(res.chunks, res.failures, [c.entry.object_key for c in m.chunks])
        return dt

    def pull_array() -> float:
        # one [layers, 2, tokens, kv_heads, head_dim] array: each chunk lands strided
        t0 = time.perf_counter()
        m = kv.lookup_fingerprints(ns, fps)
        res = kv.pull_detailed(m, out=out)
        dt = time.perf_counter() - t0
        _check_pull(res.chunks, res.failures, [c.entry.object_key for c in m.chunks])
        return dt

    def pull_plain() -> float:
        # the plain client reads kvcloud's own objects, so it may go first or last
        t0 = time.perf_counter()
        got = list(pool.map(plain.get, kv_keys))
        dt = time.perf_counter() - t0
        if sum(len(b) for b in got) != nbytes:
            raise BenchError("the plain client read back a different number of bytes")
        return dt

    def pull_encrypted() -> float:
        t0 = time.perf_counter()
        m = kv.lookup_fingerprints(ns, enc_fps, tenant=BENCH_ENC_TENANT)
        res = kv.pull_into(m, pages[:n])
        dt = time.perf_counter() - t0
        if res.chunks != n or [c.entry.object_key for c in m.chunks] != enc_keys:
            raise BenchError(f"kvcloud pulled {res.chunks} of {n} encrypted chunks")
        return dt

    def pull_array_encrypted() -> float:
        t0 = time.perf_counter()
        m = kv.lookup_fingerprints(ns, enc_fps, tenant=BENCH_ENC_TENANT)
        res = kv.pull_detailed(m, out=out)
        dt = time.perf_counter() - t0
        if res.chunks != n:
            raise BenchError(f"kvcloud pulled {res.chunks} of {n} encrypted chunks")
        return dt

    def check(dest: str) -> None:
        for i, a in enumerate(data):  # bit-exact round trips, checked off the clock
            got = pages[i] if dest == "pages" else out[:, :, i * c : (i + 1) * c]
            if not np.array_equal(got.view(np.uint8), a.view(np.uint8)):
                raise BenchError(f"chunk {i} came back different from what was pushed")

    order = [pull_kvcloud, pull_array, pull_plain]
    if encrypt:
        order[2:2] = [pull_encrypted, pull_array_encrypted]
    dest_of = {
        "pull_kvcloud": "pages",
        "pull_encrypted": "pages",
        "pull_array": "out",
        "pull_array_encrypted": "out",
    }
    timed: dict[str, list[float]] = {f.__name__: [] for f in order}
    first = order if kvcloud_first else order[::-1]
    for p in range(pull_passes):
        k = p % len(first)
        for f in first[k:] + first[:k]:
            timed[f.__name__].append(f())
            if encrypt and f.__name__ in dest_of:
                # two pulls share each destination: check each before the next overwrites it
                check(dest_of[f.__name__])
    check("pages")
    check("out")
    result = _Round(
        t_push_kv,
        t_push_plain,
        timed["pull_kvcloud"],
        timed["pull_array"],
        timed["pull_plain"],
        nbytes,
        push_encrypted=pushed.get("push_encrypted", 0.0),
        pull_encrypted=timed.get("pull_encrypted", []),
        pull_array_encrypted=timed.get("pull_array_encrypted", []),
        nbytes_encrypted=nbytes_enc,
    )
    if not keep:
        # Keep the server's state (and memory, for moto) the same size round after round.
        result.objects_deleted = _delete_objects(kv.store, pool, [*kv_keys, *plain_keys, *enc_keys])
        result.entries_dropped = sum(
            bool(kv.index.drop(ns.id, fp.hex())) for fp in [*fps, *enc_fps]
        )
    return result


def _lookup_bench(kv: KVCloud, ns: Namespace, n_chunks: int, iters: int) -> dict[str, Any]:
    """Latency of a lookup of an n-chunk prompt (all hits) next to one ping, interleaved.

    ``kvcloud`` is what a request pays: ``KVCloud.lookup`` from token ids (fingerprints, the
    index call, decoding the reply); ``fingerprints`` and ``index_lookup_run`` are its two
    parts alone."""
    rng = np.random.default_rng()
    tokens = rng.integers(0, 50_000, size=n_chunks * ns.chunk_tokens, dtype=np.int64)
    fps = kv.fingerprints(ns, tokens)
    now = time.time()
    kv.index.register_many(
        ns.id,
        [
            # Entries only: a lookup never touches the objects they name.
            (fp.hex(), IndexEntry(object_key(ns.id, content_digest(fp)), ns.chunk_tokens, 1, now))
            for fp in fps
        ],
    )
    hexes = [fp.hex() for fp in fps]
    index: Index = kv.index
    m = kv.lookup(ns, tokens)
    if len(m.chunks) != n_chunks:
        raise BenchError(f"lookup found {len(m.chunks)} of {n_chunks} registered chunks")

    calls: dict[str, Callable[[], object]] = {
        "kvcloud": lambda: kv.lookup(ns, tokens),
        "fingerprints": lambda: kv.fingerprints(ns, tokens),
        "index_lookup_run": lambda: index.lookup_run(ns.id, hexes),
        "ping": index.ping,
    }
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    warm = max(5, iters // 10)
    for it in range(warm + iters):
        # rotate the order so no method always runs right after another one
        for j in range(len(names)):
            name = names[(it + j) % len(names)]
            t0 = time.perf_counter()
            calls[name]()
            dt = time.perf_counter() - t0
            if it >= warm:
                samples[name].append(dt)
    figures = {name: _latency(s) for name, s in samples.items()}
    figures["kvcloud"]["method"] = "KVCloud.lookup (token ids)"
    figures["fingerprints"]["method"] = "KVCloud.fingerprints"
    figures["index_lookup_run"]["method"] = f"{type(index).__name__}.lookup_run"
    figures["ping"]["method"] = f"{type(index).__name__}.ping"
    return {
        "chunks": n_chunks,
        "iters": iters,
        **figures,
        "ratio_p50": figures["kvcloud"]["p50_ms"] / figures["ping"]["p50_ms"],
        "ratio_p99": figures["kvcloud"]["p99_ms"] / figures["ping"]["p99_ms"],
        "index_ratio_p50": figures["index_lookup_run"]["p50_ms"] / figures["ping"]["p50_ms"],
        "index_ratio_p99": figures["index_lookup_run"]["p99_ms"] / figures["ping"]["p99_ms"],
    }


def _index_memory_bench(index: Index, ns_id: str, n: int) -> dict[str, Any] | None:
    """Redis memory per entry: register n entries (standard object keys, as a worker
    writes them) under namespace ``ns_id`` in batches of 1,000 and divide the INFO
    used_memory delta by n. Only on a redis-server the bench started itself, which nothing
    else writes to and which is thrown away with these entries."""
    if type(index).__name__ != "RedisIndex":
        return None
    client = index._client  # type: ignore[attr-defined]  # the same server and database
    before = int(client.info("memory")["used_memory"])
    now = time.time()
    for start in range(0, n, 1000):
        batch = []
        for i in range(start, min(n, start + 1000)):
            fp = hashlib.sha256(b"mem" + i.to_bytes(8, "big")).digest()
            key = object_key(ns_id, content_digest(fp))
            batch.append((fp.hex(), IndexEntry(key, 256, 33_554_944, now)))
        index.register_many(ns_id, batch)
    after = int(client.info("memory")["used_memory"])
    info = client.info("server")
    return {
        "entries": n,
        "buckets": getattr(index, "buckets", None),
        "used_memory_before": before,
        "used_memory_after": after,
        "bytes_per_entry": (after - before) / n,
        "redis_version": info.get("redis_version"),
    }


def _delete_objects(store: ObjectStore, pool: ThreadPoolExecutor, keys: Sequence[str]) -> int:
    list(pool.map(store.delete, keys))
    return len(keys)


def _clean(kv: KVCloud, ns: Namespace) -> dict[str, int]:
    """Remove everything the bench wrote: its namespace's objects and entries, and its
    contribution to the index's counters."""
    store, index = kv.store, kv.index
    keys = [info.key for info in store.list(f"{ns.id}/")]
    with ThreadPoolExecutor(max_workers=store.max_workers) as pool:
        _delete_objects(store, pool, keys)
    if isinstance(store, FileStore):
        # The namespace directory is the bench's alone (random revision), so unlike a
        # FileStore.delete, removing its empty directories cannot race with anyone.
        shutil.rmtree(store.root / ns.id, ignore_errors=True)
    entries = 0
    for rec in list(index.iter_entries(ns.id)):
        entries += bool(index.drop(ns.id, rec.fp))
    # Every count this client made reaches the index (now or when it closes); subtracting
    # them leaves the deployment's hit/miss statistics as they were before the bench.
    counted = kv.stats()
    if counted:
        index.incr({k: -v for k, v in counted.items()})
    return {"objects_deleted": len(keys), "entries_dropped": entries}
