"""One measured round: the same chunks pushed and pulled by kvcloud (and, with ``encrypt``,
by an encrypting tenant) and by the plain client, timed and checked bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...client import KVCloud
from ...namespace import Namespace
from ...segment import encode_segment
from ...stores.base import ObjectStore
from .baselines import Plain
from .layout import BENCH_ENC_TENANT, BenchError, fresh_chain


@dataclass
class Round:
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


def run_round(
    kv: KVCloud,
    ns: Namespace,
    plain: Plain,
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
) -> Round:
    """One push + pull of ``data`` by kvcloud and by the plain client, same bytes (and, with
    ``encrypt``, by kvcloud for an encrypting tenant, under fresh fingerprints). The pulls
    run ``pull_passes`` times, the order rotating each pass so that every method takes every
    place in it once per len(methods) passes."""
    n = len(data)
    chain = fresh_chain(ns, n)
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
    enc_chain = fresh_chain(ns, n) if encrypt else []
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
    result = Round(
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
        result.objects_deleted = delete_objects(kv.store, pool, [*kv_keys, *plain_keys, *enc_keys])
        result.entries_dropped = sum(
            bool(kv.index.drop(ns.id, fp.hex())) for fp in [*fps, *enc_fps]
        )
    return result


def delete_objects(store: ObjectStore, pool: ThreadPoolExecutor, keys: Sequence[str]) -> int:
    list(pool.map(store.delete, keys))
    return len(keys)
