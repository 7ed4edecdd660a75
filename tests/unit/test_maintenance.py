"""`kvcloud verify` and `kvcloud gc` (kvcloud/tools/verify.py, gc.py) on the embedded backends
(file:// + sqlite://) and on real servers (moto_server + redis-server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pytest

from kvcloud import KVCloud, KVCloudConfig, Namespace
from kvcloud.errors import ConfigError
from kvcloud.indexes.base import IndexEntry
from kvcloud.segment import SEGMENT_VERSION, encode_segment, read_header
from kvcloud.stores.base import ObjectInfo
from kvcloud.stores.file import FileStore
from kvcloud.tools.cli import main
from kvcloud.tools.gc import gc, parse_duration, parse_size
from kvcloud.tools.inventory import is_object_key
from kvcloud.tools.verify import verify
from tests.helpers import make_kv, make_ns, make_tokens, same_bits

SESSION = "sess_" + "ab" * 16  # a realistic 128-bit id


@dataclass
class Env:
    """One backend pair plus what was pushed into it."""

    name: str
    store: str
    index: str
    root: Path | None  # file store directory (None on S3)

    def open(self) -> KVCloud:
        return KVCloud.open(store=self.store, index=self.index)

    @property
    def cli(self) -> list[str]:
        return ["--store", self.store, "--index", self.index]

    def age_everything(self, kv: KVCloud, seconds: float = 7200) -> float:
        """Make every stored object look ``seconds`` old; return the grace to use so that
        they count as old. On S3, Last-Modified cannot be set (and has 1 s resolution): wait
        a little and use a grace of 0 instead."""
        if self.root is not None:
            past = time.time() - seconds
            for info in kv.store.list():
                os.utime(self.root / info.key, (past, past))
            return 3600.0
        time.sleep(1.1)
        return 0.0


@pytest.fixture(params=["embedded", "servers"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    if request.param == "embedded":
        yield Env(
            "embedded",
            f"file://{tmp_path / 'objects'}",
            f"sqlite://{tmp_path / 'index.db'}",
            tmp_path / "objects",
        )
        return
    moto = request.getfixturevalue("moto_server")
    redis_url: str = request.getfixturevalue("redis_url")
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    store = (
        f"s3://kvcloud/{prefix}?endpoint_url={moto.endpoint}&region=us-east-1&create_bucket=true"
    )
    yield Env("servers", store, redis_url, None)


@dataclass
class Pushed:
    ns: Namespace
    prompts: list[np.ndarray]  # each 2 full chunks + a partial tail (not pushed)
    arrays: list[np.ndarray]
    keys: list[list[str]]  # object keys per prompt, in chunk order
    session_tokens: np.ndarray
    session_kv: np.ndarray
    session_keys: list[str]  # chunk keys + tail key


def populate(kv: KVCloud, n_prompts: int = 4) -> Pushed:
    ns = make_ns()
    c = ns.chunk_tokens
    prompts, arrays, keys = [], [], []
    for i in range(n_prompts):
        toks = make_tokens(2 * c + 3, seed=100 + i)
        arr = make_kv(ns, 2 * c + 3, seed=100 + i)
        res = kv.push(ns, toks, arr)
        assert res.pushed == 2
        prompts.append(toks)
        arrays.append(arr)
        keys.append(res.keys)
    # a session of 2.5 chunks: two chunk objects (with entries) and a tail only it names
    st = make_tokens(2 * c + c // 2, seed=7)
    skv = make_kv(ns, len(st), seed=7)
    rec = kv.save_session(ns, SESSION, st, skv)
    assert rec.tail_key is not None
    return Pushed(ns, prompts, arrays, keys, st, skv, rec.object_keys)


def entries(kv: KVCloud) -> set[tuple[str, str, str]]:
    return {(r.ns, r.fp, r.entry.object_key) for r in kv.index.iter_entries()}


def objects(kv: KVCloud) -> dict[str, int]:
    return {i.key: i.size for i in kv.store.list()}


def put_orphan(
    kv: KVCloud, ns: Namespace, seed: int = 55, version: int = SEGMENT_VERSION
) -> tuple[str, int]:
    """An object no entry or session names (what a crashed push leaves behind)."""
    kv_arr = make_kv(ns, ns.chunk_tokens, seed)
    seg = encode_segment(ns, bytes([seed]) * 32, ns.digest, kv_arr, version=version)
    assert kv.store.put(seg.key(), seg.data)
    return seg.key(), len(seg.data)


def replace_object(kv: KVCloud, key: str, data: bytes) -> None:
    """Out-of-band damage: objects are create-only, so delete and write again."""
    kv.store.delete(key)
    assert kv.store.put(key, data)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def check_session(kv: KVCloud, p: Pushed) -> None:
    rec = kv.load_session(p.ns, SESSION)
    res = kv.pull_session(p.ns, rec)
    assert res.tokens == len(p.session_tokens) and not res.failures
    assert same_bits(res.array, p.session_kv)


# --- verify ------------------------------------------------------------------------------------


def test_verify_clean_then_missing_object_and_repair(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify: clean → exit 0; a deleted object → missing, exit 1; --repair drops exactly
    that entry; clean again."""
    with env.open() as kv:
        p = populate(kv)
        rc, d = run_cli(["verify", *env.cli], capsys)
        assert rc == 0 and d["clean"] and d["problems"] == []
        assert d["entries_checked"] == 10  # 4 prompts × 2 chunks, the session's 2 chunks
        assert d["entries_ok"] == d["entries_checked"]
        assert d["sessions_checked"] == 1 and d["sessions_ok"] == 1
        assert d["orphans"] == 0 and d["objects"] == len(objects(kv))

        victim = p.keys[1][1]
        kv.store.delete(victim)
        before = entries(kv)
        rc, d = run_cli(["verify", *env.cli], capsys)
        assert rc == 1 and not d["clean"]
        assert (d["missing"], d["wrong_size"], d["corrupt"]) == (1, 0, 0)
        assert [(x["kind"], x["object_key"]) for x in d["problems"]] == [("missing", victim)]

        rc, d = run_cli(["verify", "--repair", *env.cli], capsys)
        # it reports what it found and fixed; everything fixed: exit 0
        assert rc == 0 and d["entries_dropped"] == 1 and d["problems_left"] == 0
        after = entries(kv)
        assert before - after == {e for e in before if e[2] == victim}
        assert len(before - after) == 1
        rc, d = run_cli(["verify", "--deep", *env.cli], capsys)
        assert rc == 0 and d["clean"]
        # the prompt now matches one chunk only, and pulls it bit-exact
        m = kv.lookup(p.ns, p.prompts[1])
        assert m.tokens == p.ns.chunk_tokens
        assert same_bits(kv.pull(m), p.arrays[1][:, :, : p.ns.chunk_tokens])


def test_verify_truncated_and_bit_flipped(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated object is a size mismatch; a bit flip keeping the size is caught only by
    --deep; --deep --repair drops both entries and deletes both bad objects, so a re-push
    stores good bytes again."""
    with env.open() as kv:
        p = populate(kv)
        short, flipped = p.keys[0][0], p.keys[2][1]
        data = kv.store.get(short)
        replace_object(kv, short, data[:-7])
        data = bytearray(kv.store.get(flipped))
        data[len(data) // 2] ^= 0x10
        replace_object(kv, flipped, bytes(data))

        r = verify(kv.store, kv.index)
        assert (r.missing, r.wrong_size, r.corrupt) == (0, 1, 0) and not r.clean
        assert r.problems[0].object_key == short

        r = verify(kv.store, kv.index, deep=True)
        assert (r.missing, r.wrong_size, r.corrupt) == (0, 1, 1)
        bad = {x.kind: x for x in r.problems}
        assert bad["corrupt"].object_key == flipped and "digest" in bad["corrupt"].detail

        rc, d = run_cli(["verify", "--deep", "--repair", *env.cli], capsys)
        assert rc == 0 and d["entries_dropped"] == 2 and d["objects_deleted"] == 2
        assert d["problems_left"] == 0 and not d["clean"]  # found, and all repaired
        assert short not in objects(kv) and flipped not in objects(kv)
        assert verify(kv.store, kv.index, deep=True).clean
        # pushing the prompts again writes fresh, valid objects under the same keys
        for i in (0, 2):
            kv.push(p.ns, p.prompts[i], p.arrays[i])
            m = kv.lookup(p.ns, p.prompts[i])
            assert m.tokens == 2 * p.ns.chunk_tokens
            assert same_bits(kv.pull(m), p.arrays[i][:, :, : m.tokens])
        assert verify(kv.store, kv.index, deep=True).clean


def test_verify_header_mismatch_and_broken_session(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """--deep catches an entry naming a valid object of another fingerprint; a session whose
    object is gone is broken (exit 1) and --repair keeps the record (only copy of its tokens),
    so it still exits 1: a problem left."""
    with env.open() as kv:
        p = populate(kv)
        rec = next(r for r in kv.index.iter_entries() if r.entry.object_key == p.keys[0][0])
        other = next(r for r in kv.index.iter_entries() if r.entry.object_key == p.keys[3][0])
        # point one entry at another (valid, same-size) object, as a swapped entry would
        assert kv.index.drop(rec.ns, rec.fp)
        kv.index.register(rec.ns, rec.fp, other.entry)
        assert verify(kv.store, kv.index).clean  # shallow: right size, so it looks fine
        r = verify(kv.store, kv.index, deep=True)
        assert r.corrupt == 1 and "fingerprint" in r.problems[0].detail

        tail = p.session_keys[-1]
        kv.store.delete(tail)
        r = verify(kv.store, kv.index, repair=True)
        assert r.sessions_broken == 1 and r.sessions_ok == 0 and not r.clean
        prob = next(x for x in r.problems if x.session)
        assert prob.kind == "session_missing_object" and prob.object_key == tail
        assert SESSION not in (prob.session or "")  # ids are credentials: prefix only
        assert kv.load_session(p.ns, SESSION).tail_key == tail  # record kept
        rc, d = run_cli(["verify", "--repair", *env.cli], capsys)
        assert rc == 1 and d["problems_left"] == 1 and d["sessions_broken"] == 1
        # the session still resumes: its full chunks, then recompute the tail
        res = kv.pull_session(p.ns, kv.load_session(p.ns, SESSION))
        assert res.tokens == 2 * p.ns.chunk_tokens


def test_orphan_is_counted_not_a_problem(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """An object with no entry is an orphan: counted with its bytes, exit status 0."""
    with env.open() as kv:
        p = populate(kv)
        _, size = put_orphan(kv, p.ns)
        rc, d = run_cli(["verify", "--deep", *env.cli], capsys)
        assert rc == 0 and d["clean"]
        assert (d["orphans"], d["orphan_bytes"]) == (1, size)
        assert d["objects"] == d["referenced_objects"] + 1


def test_unreadable_session_record(env: Env) -> None:
    """A session record that does not parse is a problem for verify, and gc deletes no
    object while one exists (it could name any of them)."""
    with env.open() as kv:
        p = populate(kv)
        put_orphan(kv, p.ns)
        kv.index.put_session("0" * 32, "sess_garbage", b"\xc1 not msgpack")
        r = verify(kv.store, kv.index)
        assert r.sessions_unreadable == 1 and r.sessions_broken == 1 and not r.clean
        before = objects(kv)
        g = gc(kv.store, kv.index, grace_seconds=env.age_everything(kv))
        assert g.skipped and g.objects_deleted == 0 and objects(kv) == before


def test_deep_verify_of_encrypted_objects(tmp_path: Path) -> None:
    """--deep checks an encrypted tenant's objects without its key: digest and header (the
    tag needs the tenant's key, which verify does not hold); a bit flip is still caught."""
    if "encrypt_tenants" not in {f.name for f in fields(KVCloudConfig)}:
        pytest.skip("this build has no encryption at rest")
    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}"
    ns = make_ns()
    with KVCloud.open(store=store, index=index, encrypt_tenants="acme") as kv:
        res = kv.push(ns, make_tokens(48, seed=4), make_kv(ns, 48, seed=4), tenant="acme")
        assert res.pushed == 3
        assert read_header(kv.store.get(res.keys[0]))[0].encryption["alg"] != "none"
        r = verify(kv.store, kv.index, deep=True)
        assert r.clean and r.entries_ok == 3
        data = bytearray(kv.store.get(res.keys[1]))
        data[-3] ^= 1
        replace_object(kv, res.keys[1], bytes(data))
        r = verify(kv.store, kv.index, deep=True)
        assert r.corrupt == 1 and r.problems[0].object_key == res.keys[1]


# --- gc ----------------------------------------------------------------------------------------


def test_gc_grace_keeps_young_then_deletes_only_the_orphan(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """gc --grace 1h deletes nothing young; once old, only the orphan goes — never a
    referenced object, including session-only ones (its tail, a chunk whose entry is gone)."""
    with env.open() as kv:
        p = populate(kv)
        orphan, size = put_orphan(kv, p.ns)
        # a session chunk whose entry was dropped is referenced by the session alone
        sess_chunk = p.session_keys[0]
        rec = next(r for r in kv.index.iter_entries() if r.entry.object_key == sess_chunk)
        assert kv.index.drop(rec.ns, rec.fp, sess_chunk)
        before = objects(kv)

        rc, d = run_cli(["gc", *env.cli], capsys)  # default grace: 1 h
        assert rc == 0 and d["objects_deleted"] == 0 and d["grace_seconds"] == 3600
        assert d["kept_young"] == 1 and d["kept_young_bytes"] == size
        assert objects(kv) == before

        grace = env.age_everything(kv)
        rc, d = run_cli(["gc", "--grace", f"{int(grace)}s", "--settle", "0", *env.cli], capsys)
        assert rc == 0 and d["objects_deleted"] == 1 and d["bytes_freed"] == size
        assert d["deleted_keys"] == [orphan]
        after = objects(kv)
        assert set(before) - set(after) == {orphan}
        assert p.session_keys[-1] in after and sess_chunk in after
        assert verify(kv.store, kv.index, deep=True).clean
        check_session(kv, p)
        for toks, arr in zip(p.prompts, p.arrays, strict=True):
            m = kv.lookup(p.ns, toks)
            assert same_bits(kv.pull(m), arr[:, :, : m.tokens]) and m.tokens == 32
        # nothing left to collect
        assert gc(kv.store, kv.index, grace_seconds=grace).objects_deleted == 0


def test_old_sha256_and_new_blake3_objects_in_one_store(env: Env) -> None:
    """A store an older build wrote (format v1, SHA-256 keys) keeps working after the
    upgrade: chains mixing v1 and v2 objects pull bit-exact, verify --deep checks both, a
    damaged v1 object is found, and gc collects orphans of both forms and nothing else."""
    with env.open() as kv:
        ns = make_ns()
        c = ns.chunk_tokens
        toks = make_tokens(3 * c, seed=21)
        arr = make_kv(ns, 3 * c, seed=21)
        # an older build pushed the first two chunks (v1 is what KVCLOUD_SEGMENT_VERSION=1
        # writes, byte for byte what earlier releases wrote)
        with KVCloud.open(store=env.store, index=env.index, segment_version=1) as older:
            old = older.push(ns, toks[: 2 * c + 1], arr[:, :, : 2 * c + 1]).keys
        seg = encode_segment(ns, bytes([61]) * 32, ns.digest, make_kv(ns, c, 61), version=1)
        assert kv.store.put(seg.key(), seg.data)
        orphan_v1, size_v1 = seg.key(), len(seg.data)
        # this build extends the same prompt: only the new chunk is written, in v3
        res = kv.push(ns, toks, arr)
        assert res.pushed == 1 and res.keys[:2] == old
        new = res.keys[2:]
        assert all(not k.endswith((".b3", ".b3l")) for k in old) and new[0].endswith(".b3l")
        assert {read_header(kv.store.get(k))[0].version for k in old} == {1}
        assert read_header(kv.store.get(new[0]))[0].version == 3
        orphan_v2, size_v2 = put_orphan(kv, ns, seed=62, version=2)
        assert orphan_v2.endswith(".b3") and is_object_key(orphan_v2) and is_object_key(orphan_v1)

        m = kv.lookup(ns, toks)
        assert m.tokens == 3 * c
        assert same_bits(kv.pull(m), arr)
        r = verify(kv.store, kv.index, deep=True)
        assert r.clean and r.entries_ok == 3 and r.orphans == 2

        # bit rot in an old object: found by --deep, and a restore stops before it
        data = bytearray(kv.store.get(old[1]))
        data[-3] ^= 0x20
        replace_object(kv, old[1], bytes(data))
        r = verify(kv.store, kv.index, deep=True)
        assert r.corrupt == 1 and r.problems[0].object_key == old[1]
        bad_size = len(data)
        res = kv.pull_into(kv.lookup(ns, toks), list(np.zeros((3, *ns.kv_shape(c)), arr.dtype)))
        assert res.chunks == 1  # and the client dropped the bad object's entry
        # and, its bytes not matching its key, deleted it (after the entry): gc has the
        # two orphans left
        assert kv.store.head(old[1]) is None and bad_size > 0

        grace = env.age_everything(kv)
        g = gc(kv.store, kv.index, grace_seconds=grace, settle_seconds=0)
        assert sorted(g.deleted_keys) == sorted([orphan_v1, orphan_v2])
        assert g.bytes_freed == size_v1 + size_v2
        assert set(objects(kv)) == {old[0], *new}


def test_gc_max_bytes_trims_least_recently_used_entries_first(env: Env) -> None:
    """--max-bytes drops the least-recently-used entries (lookups make entries recent), then
    deletes the objects that left unreferenced; session objects are never trimmed."""
    # A hit is renewed once its expiry is a hundredth of the TTL old (at most a minute): with
    # a 100 s TTL, lookups 1.5 s after the pushes renew their entries.
    sep = "&" if "?" in env.index else "?"
    with KVCloud.open(store=env.store, index=f"{env.index}{sep}ttl=100") as kv:
        p = populate(kv)
        time.sleep(1.5)
        for i in (1, 3):  # used recently
            assert kv.lookup(p.ns, p.prompts[i]).tokens == 32
        kv.index.counters()  # Redis sends TTL renewals in the background: flush them
        sizes = objects(kv)
        keep = [k for i in (1, 3) for k in p.keys[i]]
        budget = sum(sizes[k] for k in keep) + sum(sizes[k] for k in p.session_keys)
        grace = env.age_everything(kv)

        r = gc(kv.store, kv.index, grace_seconds=grace, max_bytes=budget, settle_seconds=0)
        assert r.entries_dropped == 4 and not r.over_budget
        assert r.referenced_bytes_after <= budget < r.referenced_bytes_before
        gone = {k for i in (0, 2) for k in p.keys[i]}
        assert r.objects_deleted == 4 and set(r.deleted_keys) == gone
        assert r.bytes_freed == sum(sizes[k] for k in gone) == r.entry_bytes_dropped
        assert set(objects(kv)) == set(sizes) - gone
        for i in (0, 2):
            assert kv.lookup(p.ns, p.prompts[i]).tokens == 0
        for i in (1, 3):
            m = kv.lookup(p.ns, p.prompts[i])
            assert same_bits(kv.pull(m), p.arrays[i][:, :, :32])
        check_session(kv, p)
        assert verify(kv.store, kv.index, deep=True).clean

        # a budget below what sessions alone need: every other entry goes, sessions stay
        r = gc(kv.store, kv.index, grace_seconds=grace, max_bytes=1, settle_seconds=0)
        assert r.over_budget and r.entries_dropped == 4
        check_session(kv, p)
        assert verify(kv.store, kv.index).clean


def test_gc_dry_run_changes_nothing(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run reports what it would drop and delete and leaves everything in place."""
    with env.open() as kv:
        p = populate(kv)
        orphan, _ = put_orphan(kv, p.ns)
        grace = env.age_everything(kv)
        objs, ents = objects(kv), entries(kv)
        rc, d = run_cli(
            ["gc", "--dry-run", "--grace", str(int(grace)), "--max-bytes", "1", *env.cli], capsys
        )
        assert rc == 0 and d["dry_run"]
        assert d["entries_dropped"] == 8  # every entry but the session's two
        assert d["objects_deleted"] == 9 and orphan in d["deleted_keys"]
        assert not set(d["deleted_keys"]) & set(p.session_keys)
        assert objects(kv) == objs and entries(kv) == ents
        # the real run does what the dry run said
        r = gc(kv.store, kv.index, grace_seconds=grace, max_bytes=1, settle_seconds=0)
        assert (r.entries_dropped, r.objects_deleted) == (8, 9)
        assert sorted(r.deleted_keys) == sorted(d["deleted_keys"])
        check_session(kv, p)


# --- gc against a push in flight (deterministic interleavings, file store) --------------------


class _ScriptedStore(FileStore):
    """A file store that runs a hook at a chosen moment of gc, as a concurrent push would."""

    after_list = None  # called once the listing is complete
    before_delete = None  # called with the key, just before it is deleted

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from list(super().list(prefix))
        if self.after_list:
            self.after_list()

    def delete(self, key: str) -> None:
        if self.before_delete:
            self.before_delete(key)
        super().delete(key)


def _orphaned_prefix(tmp_path: Path) -> tuple[KVCloud, Namespace, np.ndarray, np.ndarray, str]:
    """A pushed 1-chunk prefix whose entry expired: its object is an old orphan."""
    store = _ScriptedStore(tmp_path / "o")
    kv = KVCloud.open(store=store, index=f"sqlite://{tmp_path / 'i.db'}")
    ns = make_ns()
    toks, arr = make_tokens(16, seed=3), make_kv(ns, 16, seed=3)
    key = kv.push(ns, toks, arr).keys[0]
    rec = next(kv.index.iter_entries())
    kv.index.drop(rec.ns, rec.fp)
    past = time.time() - 7200
    os.utime(store.root / key, (past, past))
    return kv, ns, toks, arr, key


def test_gc_keeps_an_old_orphan_a_push_touches_after_the_listing(tmp_path: Path) -> None:
    """A push that reuses an old orphan (touch, then register) after gc listed the store is
    seen by the fresh HEAD before deleting: the object is kept and its new entry works."""
    kv, ns, toks, arr, key = _orphaned_prefix(tmp_path)
    # the push's first half (put finds the object, touches it) lands right after the LIST;
    # its entry is registered only after gc has read the index
    kv.store.after_list = lambda: kv.store.touch(key)  # type: ignore[attr-defined]
    r = gc(kv.store, kv.index, grace_seconds=3600)
    assert (r.unreferenced, r.kept_young, r.kept_touched, r.objects_deleted) == (1, 0, 1, 0)
    res = kv.push(ns, toks, arr)  # the second half: register
    assert res.pushed == 1 and res.objects_written == 0
    m = kv.lookup(ns, toks)
    assert m.tokens == 16 and same_bits(kv.pull(m), arr)
    assert verify(kv.store, kv.index, deep=True).clean
    kv.close()


def test_gc_drops_an_entry_registered_while_its_object_was_deleted(tmp_path: Path) -> None:
    """The last window: a push touches the object between gc's HEAD and DELETE and registers
    its entry; gc's sweep after deleting drops that entry, so none names a missing object."""
    kv, ns, toks, arr, key = _orphaned_prefix(tmp_path)
    store: _ScriptedStore = kv.store  # type: ignore[assignment]

    def racing_push(k: str) -> None:
        store.before_delete = None
        assert k == key
        res = kv.push(ns, toks, arr)  # put finds the object, touches it, registers
        assert res.pushed == 1 and res.objects_written == 0

    store.before_delete = racing_push
    r = gc(kv.store, kv.index, grace_seconds=3600, settle_seconds=0)
    assert r.objects_deleted == 1 and r.dangling_dropped == 1
    assert verify(kv.store, kv.index).clean
    assert kv.lookup(ns, toks).tokens == 0  # a miss; the next push stores it again
    kv.push(ns, toks, arr)
    assert same_bits(kv.pull(kv.lookup(ns, toks)), arr)
    kv.close()


def test_gc_settle_drops_an_entry_registered_just_after_the_delete(tmp_path: Path) -> None:
    """A push that found the object just before gc deleted it, and registers its entry only
    afterwards (its touch failed unnoticed), is caught by gc's second look after
    ``settle_seconds``: no entry is left naming the deleted object."""
    kv, _ns, _toks, _arr, key = _orphaned_prefix(tmp_path)
    store: _ScriptedStore = kv.store  # type: ignore[assignment]
    entry = IndexEntry(key, 16, len(store.get(key)), time.time())
    ns_id = key.split("/", 1)[0]
    late: list[threading.Thread] = []

    def slow_push(k: str) -> None:
        def register() -> None:
            time.sleep(0.3)  # after the delete and after gc's first look
            kv.index.register(ns_id, "ab" * 32, entry)

        late.append(threading.Thread(target=register))
        late[-1].start()

    store.before_delete = slow_push
    r = gc(kv.store, kv.index, grace_seconds=3600, settle_seconds=1.0)
    late[0].join()
    assert r.objects_deleted == 1 and r.dangling_dropped == 1
    assert verify(kv.store, kv.index).clean
    kv.close()


def test_gc_ignores_foreign_keys(tmp_path: Path) -> None:
    """Objects whose keys are not kvcloud's <ns>/<d[:2]>/<d> are never deleted."""
    with KVCloud.open(store=f"file://{tmp_path / 'o'}", index=f"sqlite://{tmp_path / 'i'}") as kv:
        kv.store.put("other-app/data.bin", b"not ours")
        kv.store.put("0" * 32 + "/ab/" + "cd" * 32, b"prefix does not match the digest")
        past = time.time() - 7200
        for info in kv.store.list():
            os.utime(tmp_path / "o" / info.key, (past, past))
        r = gc(kv.store, kv.index, grace_seconds=60)
        assert r.foreign_objects == 2 and r.objects_deleted == 0
        assert len(objects(kv)) == 2
        v = verify(kv.store, kv.index)
        assert v.clean and v.orphans == 0 and v.foreign_objects == 2


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_human_output_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Human output names the counts; bad flags and unreachable backends are one line, exit 2."""
    env = Env("embedded", f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}", None)
    with env.open() as kv:
        p = populate(kv)
        kv.store.delete(p.keys[0][1])
    assert main(["verify", *env.cli]) == 1
    out = capsys.readouterr().out
    assert "1 missing" in out and "problems found" in out and p.keys[0][1] in out
    assert main(["gc", "--grace", "15m", "--max-bytes", "2GiB", "--dry-run", *env.cli]) == 0
    out = capsys.readouterr().out
    assert "would delete 0" in out and "fits" in out
    assert main(["gc", "--grace", "soon", *env.cli]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "duration" in err
    assert main(["gc", "--max-bytes", "lots", *env.cli]) == 2
    assert "size" in capsys.readouterr().err

    from tests.servers import free_port

    for cmd in (["verify"], ["gc", "--dry-run"]):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvcloud.tools.cli",
                *cmd,
                "--store",
                env.store,
                "--index",
                f"redis://:hunter2@127.0.0.1:{free_port()}/0",
                "--json",
            ],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "KVCLOUD_CONNECT_TIMEOUT": "0.5"},
        )
        assert r.returncode == 2 and r.stdout == ""
        assert "Traceback" not in r.stderr and "hunter2" not in r.stderr
        assert r.stderr.strip().count("\n") == 0


def test_parse_duration_and_size() -> None:
    """--grace and --max-bytes accept units and plain numbers."""
    assert parse_duration("30s") == 30 and parse_duration("15m") == 900
    assert parse_duration("2h") == 7200 and parse_duration("1d") == 86400
    assert parse_duration("45") == 45 and parse_duration("0") == 0 and parse_duration(1.5) == 1.5
    assert parse_duration("1.5h") == 5400 and parse_duration("500ms") == 0.5
    assert parse_size("500MB") == 500_000_000 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("123") == 123 and parse_size("10k") == 10_000 and parse_size("1 KiB") == 1024
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("7b") == 7
    for bad in ("", "soon", "-5s", "1y"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    for bad in ("", "lots", "-1", "5XB"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    assert is_object_key("0" * 32 + "/ab/ab" + "0" * 62)
    assert not is_object_key("0" * 32 + "/ac/ab" + "0" * 62)
