"""Redis index bookkeeping: live entries, bytes and tokens per namespace at a cost independent
of the index's size, a bounded random sample of entries, and reads that mark nothing as used.
What ``kvcloud stats --serve`` reads (:meth:`Bookkeeping.summary`).

Every entry expires at a known time (in its value, or the field's TTL), so the index counts
entries by *expiry slot*, per namespace in one hash::

    {prefix}:n:{ns}        e{k}:{slot} entries, b{k}:{slot} bytes, t{k}:{slot} tokens; since
    {prefix}:namespaces    set of the namespaces that have one

A slot is 2^k ms of expiry time, k from the writer's TTL (about 1,024 slots per TTL; the name
carries k, so writers with different TTLs add up). A registration adds an entry to the slot
of its expiry, a renewal moves it to the slot of its new expiry, a drop takes it out; an
entry that expires needs no write at all: its slot passes. The live figures at time t are the
sums over the slots that end after t, exact but for the slot that contains t (its entries
count as live until it ends: those expiring in the current 1/1,024 of a TTL). Neither hash
has a TTL, so ``volatile-lru`` never evicts them.

The tallies are sent after the write they describe (with the index's next background batch,
or right after a renewal script), not inside it: on a Redis Cluster the bucket and the
namespace's hash sit in different slots. A tally that is lost (a worker killed between its
write and the tally, a bucket evicted or deleted by hand) makes the figures drift, and every
such drift heals by itself within one TTL, when the slot it sits in passes. Likewise after an
upgrade: entries written before the bookkeeping began (``since``) are counted once renewed
and their old slot has passed, so the figures are complete one TTL after ``since``.

Reads for stats renew no TTL (they never go through ``lookup``), and with the URL option
``no_touch=on`` every command of the index runs after ``CLIENT NO-TOUCH ON`` (Redis 7.2+,
Valkey 8+), so they leave the LRU/LFU clocks that ``maxmemory-policy`` evicts by as they were.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from redis import exceptions as rexc

from .base import EntryRecord, IndexEntry, IndexSummary, NamespaceTotals
from .redis_layout import _component, entry_record, glob_escape, unpack_value

log = logging.getLogger("kvcloud.index")

SLOTS_PER_TTL = 1024
# Buckets a sample reads per namespace at most, and per pipeline.
SAMPLE_BUCKETS = 256
_SAMPLE_BATCH = 32
# Sessions are counted exactly (one SCAN) in a database of at most this many keys, else
# estimated from this many RANDOMKEYs.
EXACT_SESSION_KEYS = 10_000
SESSION_PROBES = 512
# Index URLs whose server refused CLIENT NO-TOUCH in this process: warned about once.
REFUSED_NO_TOUCH: set[str] = set()
# Slots that ended this long ago are deleted by a reader (a late tally may still land in a
# slot that just ended; it is harmless there, and deleted later).
_TRIM_AFTER_MS = 3_600_000


def slot_bits(ttl_seconds: float) -> int:
    """k such that a slot of 2^k ms is about 1/SLOTS_PER_TTL of the TTL (0: 1 ms)."""
    return max(0, (max(1, int(ttl_seconds * 1000)) // SLOTS_PER_TTL).bit_length() - 1)


class Tally(NamedTuple):
    """A change to one field of a namespace's bookkeeping hash: a counter name that the
    index's background sender (:class:`~kvcloud.indexes.deferred.Deferred`) carries."""

    ns: str
    field: str


def add_tally(
    out: dict[Any, int], k: int, ns: str, expires_ms: float, entry: IndexEntry, sign: int
) -> None:
    slot = int(expires_ms) >> k
    for kind, n in (("e", 1), ("b", entry.size), ("t", entry.n_tokens)):
        key = Tally(ns, f"{kind}{k}:{slot}")
        out[key] = out.get(key, 0) + sign * n


def _slot_of(field: bytes) -> tuple[str, int, int] | None:
    """(kind, k, slot) of a bookkeeping field, None for anything else."""
    text = field.decode("ascii", "replace")
    kind, (k, sep, slot) = text[:1], text[1:].partition(":")
    if kind not in ("e", "b", "t") or not sep or not k.isdigit():
        return None
    try:
        return kind, int(k), int(slot)
    except ValueError:
        return None


def no_touch_hook(index: Any, run_on_connect: bool) -> Callable[[Any], None]:
    """A redis-py ``redis_connect_func`` that turns CLIENT NO-TOUCH on for every connection
    (``run_on_connect``: the standard handshake first; a cluster client runs it itself). A
    server that refuses it (Redis before 7.2) is warned about once and used as it is."""

    ref = weakref.ref(index)  # the client holds this hook: no cycle back to the index

    def connect(conn: Any) -> None:
        if run_on_connect:
            conn.on_connect()
        index = ref()
        if index is None or index.lru_untouched is False:
            return
        if index.url in REFUSED_NO_TOUCH:  # asked before (an exporter opens one a scan)
            index.lru_untouched = False
            return
        try:
            conn.send_command("CLIENT", "NO-TOUCH", "ON")
            conn.read_response()
        except rexc.ResponseError as exc:
            index.lru_untouched = False
            REFUSED_NO_TOUCH.add(index.url)
            log.warning(
                "redis index %s: the server refused CLIENT NO-TOUCH (%s; Redis 7.2+ and Valkey "
                "have it): reads for stats mark what they read as recently used for "
                "maxmemory-policy",
                index.url,
                exc,
            )
        else:
            index.lru_untouched = True

    return connect


class Bookkeeping:
    """The bookkeeping side of :class:`~kvcloud.indexes.redis.RedisIndex` (mixed into it)."""

    # provided by RedisIndex and its KeyLayout
    prefix: str
    buckets: int
    ttl_seconds: int
    url: str
    _client: Any
    _deferred: Any
    _scripts: Any
    _single_key: bool
    #: True once CLIENT NO-TOUCH was accepted, False if refused, None if never asked
    lru_untouched: bool | None = None

    _bucket_head: Callable[[str], str]
    _split_key: Callable[[bytes | str, str], tuple[str, str] | None]
    _scan: Callable[[str], Iterable[bytes]]
    _errors: Callable[[], Any]
    counters: Callable[[], dict[str, int]]

    def _stats_key(self, ns: str) -> str:
        return f"{self.prefix}:n:{_component(ns)}"

    @property
    def _registry_key(self) -> str:
        return f"{self.prefix}:namespaces"

    # -- writers ----------------------------------------------------------------------------

    def _tally_registered(
        self, ns: str, entries: list[tuple[str, IndexEntry]], created: list[bool], now: float
    ) -> None:
        new = [entry for (_, entry), made in zip(entries, created, strict=True) if made]
        if not new:
            return
        k = slot_bits(self.ttl_seconds)
        slot = int((now + self.ttl_seconds) * 1000) >> k  # one expiry for the whole batch
        self._deferred.submit(
            (),
            {
                Tally(ns, f"e{k}:{slot}"): len(new),
                Tally(ns, f"b{k}:{slot}"): sum(e.size for e in new),
                Tally(ns, f"t{k}:{slot}"): sum(e.n_tokens for e in new),
            },
        )

    def _tally_dropped(self, ns: str, reply: Any) -> None:
        """``reply``: the drop script's (value, field expiry in ms or -1)."""
        try:
            entry, expires_at = unpack_value(ns, reply[0])
        except Exception:
            return  # a garbage value was never counted
        expires_ms = expires_at * 1000 if expires_at is not None else int(reply[1])
        if expires_ms > 0:
            out: dict[Any, int] = {}
            add_tally(out, slot_bits(self.ttl_seconds), ns, expires_ms, entry, -1)
            self._deferred.submit((), out)

    def _tally_renewed(self, items: list[Any], replies: list[Any], now: float) -> None:
        """Move the entries the renewal scripts renewed to their new expiry's slot. ``items``
        are the (bucket, field) pairs sent, ``replies`` the scripts' (i, old expiry, value)
        lists, one per batch of ``step`` items."""
        out: dict[Any, int] = {}
        k, new_ms = slot_bits(self.ttl_seconds), (now + self.ttl_seconds) * 1000
        step = self._scripts.step
        for batch, reply in enumerate(replies):
            if not isinstance(reply, list):
                continue
            for j in range(0, len(reply) - 2, 3):
                i, was, raw = int(reply[j]), int(reply[j + 1]), reply[j + 2]
                parts = self._split_key(items[batch * step + i - 1][0], "h")
                if parts is None:
                    continue
                try:
                    entry, expires_at = unpack_value(parts[0], raw)
                except Exception:
                    continue
                old_ms = expires_at * 1000 if expires_at is not None else was
                if old_ms > 0:
                    add_tally(out, k, parts[0], old_ms, entry, -1)
                    add_tally(out, k, parts[0], new_ms, entry, +1)
        if not out:
            return
        try:
            with self._errors():
                pipe = self._client.pipeline(transaction=False)
                self._write_tallies(pipe, out, now)
                pipe.execute()
        except Exception as exc:  # sent again with the next batch
            log.debug("redis index %s: bookkeeping deferred: %s", self.url, exc)
            self._deferred.submit((), out)

    def _write_tallies(self, pipe: Any, tallies: Mapping[Tally, int], now: float) -> None:
        """Add ``tallies`` to their namespaces' hashes; per namespace also note when its
        bookkeeping began, register it, and delete the two slots that just ended."""
        by_ns: dict[str, list[tuple[str, int]]] = {}
        for t, n in tallies.items():
            if n:
                by_ns.setdefault(t.ns, []).append((t.field, int(n)))
        k = slot_bits(self.ttl_seconds)
        ended = (int(now * 1000) >> k) - 1
        for ns, fields in by_ns.items():
            key = self._stats_key(ns)
            for field, n in fields:
                pipe.hincrby(key, field, n)
            pipe.hsetnx(key, "since", repr(now))
            pipe.hdel(key, *(f"{c}{k}:{s}" for s in (ended, ended - 1) for c in "ebt"))
            pipe.sadd(self._registry_key, ns)

    # -- readers ----------------------------------------------------------------------------

    def _field_ttls(
        self, keys: list[Any], hashes: list[dict[bytes, bytes]]
    ) -> dict[tuple[Any, bytes], int]:
        """The TTL (ms; -1 none, -2 gone) of every field-TTL value among ``hashes``, one
        pipelined HPTTL per bucket that holds any (off the request path: stats, gc, verify)."""
        wanted = [
            (key, [f for f, raw in fields.items() if raw[:1] == b"\x02"])
            for key, fields in zip(keys, hashes, strict=True)
        ]
        wanted = [(key, fields) for key, fields in wanted if fields]
        if not wanted:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for key, fields in wanted:
            pipe.execute_command("HPTTL", key, "FIELDS", len(fields), *fields)
        out: dict[tuple[Any, bytes], int] = {}
        for (key, fields), reply in zip(wanted, pipe.execute(), strict=True):
            for field, ms in zip(fields, reply, strict=True):
                out[(key, field)] = int(ms)
        return out

    def summary(self, sample_size: int = 512) -> IndexSummary:
        """The live figures of every namespace from the bookkeeping (one HGETALL each), a
        sample of at most ``sample_size`` entries per namespace (at most SAMPLE_BUCKETS random
        buckets read), sessions (exact in a small database, else estimated) and counters."""
        now = time.time()
        rng = random.Random()
        with self._errors():
            namespaces, since = self._read_tallies(now)
            sample = [r for ns in namespaces for r in self._sample(ns, sample_size, now, rng)]
            sessions, exact = self._count_sessions(rng)
        return IndexSummary(namespaces, sessions, exact, self.counters(), sample, since)

    def _read_tallies(self, now: float) -> tuple[dict[str, NamespaceTotals], dict[str, float]]:
        names = sorted(m.decode() for m in self._client.smembers(self._registry_key))
        pipe = self._client.pipeline(transaction=False)
        for ns in names:
            pipe.hgetall(self._stats_key(ns))
        now_ms = now * 1000
        totals: dict[str, NamespaceTotals] = {}
        since: dict[str, float] = {}
        ended: dict[str, list[bytes]] = {}
        for ns, fields in zip(names, pipe.execute(), strict=True):
            sums = {"e": 0, "b": 0, "t": 0}  # over the slots not yet ended
            for field, value in fields.items():
                if field == b"since":
                    since[ns] = float(value)
                    continue
                slot = _slot_of(field)
                if slot is None:
                    continue
                kind, k, number = slot
                end = (number + 1) << k
                if end > now_ms:
                    sums[kind] += int(value)
                elif end < now_ms - _TRIM_AFTER_MS:
                    ended.setdefault(ns, []).append(field)
            if sums["e"] > 0:
                totals[ns] = NamespaceTotals(*(max(0, sums[c]) for c in "ebt"))
        self._trim(ended)
        return totals, since

    def _trim(self, ended: dict[str, list[bytes]]) -> None:
        """Delete slots that ended long ago (writers delete the ones that just ended; these
        are what is left after a pause); a reader without write access leaves them."""
        if not ended:
            return
        pipe = self._client.pipeline(transaction=False)
        for ns, fields in ended.items():
            for i in range(0, len(fields), 1000):
                pipe.hdel(self._stats_key(ns), *fields[i : i + 1000])
        try:
            pipe.execute()
        except rexc.RedisError as exc:
            log.debug("redis index %s: old bookkeeping slots left: %s", self.url, exc)

    def _sample(self, ns: str, n: int, now: float, rng: random.Random) -> list[EntryRecord]:
        """Live entries of random buckets of ``ns`` until ``n`` (buckets are picked by the
        fingerprint's hash, so a bucket's entries are a random draw)."""
        if n <= 0:
            return []
        head = self._bucket_head(ns)
        numbers = rng.sample(range(self.buckets), min(self.buckets, SAMPLE_BUCKETS))
        out: list[EntryRecord] = []
        for i in range(0, len(numbers), _SAMPLE_BATCH):
            keys = [f"{head}{b:x}" for b in numbers[i : i + _SAMPLE_BATCH]]
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            hashes = pipe.execute()
            ttls = self._field_ttls(keys, hashes)
            for key, fields in zip(keys, hashes, strict=True):
                for field, raw in fields.items():
                    rec = entry_record(ns, field, raw, now, ttls.get((key, field)))
                    if rec is not None:
                        out.append(rec)
            if len(out) >= n:
                break
        return rng.sample(out, n) if len(out) > n else out

    def _count_sessions(self, rng: random.Random) -> tuple[int, bool]:
        pattern = f"{glob_escape(self.prefix)}:s:*"
        size = int(self._client.dbsize())
        if size <= EXACT_SESSION_KEYS:
            return sum(1 for _ in self._scan(pattern)), True
        probes = SESSION_PROBES
        if self._single_key:  # a cluster pipeline cannot route a command without a key
            keys = [self._client.randomkey() for _ in range(probes // 4)]
        else:
            pipe = self._client.pipeline(transaction=False)
            for _ in range(probes):
                pipe.randomkey()
            keys = pipe.execute()
        hits = sum(1 for key in keys if key is not None and self._split_key(key, "s"))
        return round(size * hits / max(1, len(keys))), False


__all__ = ["SLOTS_PER_TTL", "Bookkeeping", "Tally", "no_touch_hook", "slot_bits"]
