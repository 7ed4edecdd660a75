"""Encryption at rest (issue 5): per-tenant AES-256-GCM, against a real file store + SQLite and
real moto_server + redis-server processes.

What must hold: encrypted tenants round-trip bit-exactly; their stored objects hold no
plaintext KV; equal chunks still dedup to one object; another tenant (another key) gets
nothing; any tampering — including a tampered object re-stored under its own correct digest
with the index rewritten to point at it — is a verified miss; unencrypted tenants keep
today's exact bytes; key ids and errors reveal neither tenant names nor the secret.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvcloud import KVCloud, KVCloudConfig, Namespace
from kvcloud.crypto import ALG, TAG_BYTES, derive_data_key, key_id
from kvcloud.errors import (
    ConfigError,
    CorruptObjectError,
    DecryptionError,
)
from kvcloud.indexes.base import IndexEntry
from kvcloud.segment import (
    content_digest,
    decode_segment,
    encode_segment,
    object_key,
    read_header,
)
from tests.helpers import (
    DTYPE_CASES,
    frame_object,
    make_kv,
    make_ns,
    make_tokens,
    readdress,
    same_bits,
)
from tests.integration.conftest import Backends
from tests.servers import MotoServer

SECRET = "unit-test-master-secret-7f3a9c"
TENANT = "acme-corporation"


@pytest.fixture(params=["embedded", "servers"])
def backends(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backends]:
    """file:// + sqlite:// and moto_server + redis-server (as tests/integration does)."""
    if request.param == "embedded":
        yield Backends(
            "embedded", f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
        )
    else:
        moto: MotoServer = request.getfixturevalue("moto_server")
        redis_url: str = request.getfixturevalue("redis_url")
        prefix = f"enc-{uuid.uuid4().hex[:12]}"
        yield Backends(
            "servers",
            f"s3://kvcloud/{prefix}?endpoint_url={moto.endpoint}"
            "&region=us-east-1&create_bucket=true",
            redis_url,
        )


def _open(b: Backends, encrypt: str = TENANT, **kw: object) -> KVCloud:
    return b.open(secret=SECRET, encrypt_tenants=encrypt, **kw)


def _objects(kv: KVCloud) -> dict[str, bytes]:
    return {i.key: kv.store.get(i.key) for i in kv.store.list()}


def pattern_kv(ns: Namespace, n_tokens: int, salt: int = 0) -> np.ndarray:
    """KV whose bytes are readable text that never repeats (every 64-byte window is unique),
    so finding any window of it in a stored object means plaintext leaked."""
    nbytes = int(np.prod(ns.kv_shape(n_tokens))) * ns.dtype_info.itemsize
    text = b"".join(b"<PLAINTEXT-KV %d/%08d>" % (salt, i) for i in range(nbytes // 20 + 1))
    raw = np.frombuffer(text[:nbytes], dtype=np.uint8)
    return raw.view(np.dtype(ns.dtype_info.storage)).reshape(ns.kv_shape(n_tokens))


def _windows(data: bytes, w: int = 64) -> set[bytes]:
    return {data[i : i + w] for i in range(len(data) - w + 1)}


def _leaked(plain: bytes, stored: bytes, w: int = 64) -> int:
    """How many of the plaintext's w-byte windows (every offset) occur in the stored bytes."""
    have = _windows(stored, w)
    return sum(plain[i : i + w] in have for i in range(len(plain) - w + 1))


def _split(data: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack_from("<I", data, 4)
    return msgpack.unpackb(data[8 : 8 + hlen], raw=False), data[8 + hlen :]


def _frame(header: dict, payload: bytes) -> bytes:
    return frame_object(header, payload)


def _point_entry_at(kv: KVCloud, ns: Namespace, fp: bytes, data: bytes) -> str:
    """The attacker's move: store ``data`` under its own correct content address and rewrite
    the index entry of ``fp`` to name it. Every digest check passes afterwards."""
    key = object_key(ns.id, content_digest(data))
    kv.store.put(key, data)
    kv.index.drop(ns.id, fp.hex())
    assert kv.index.register(ns.id, fp.hex(), IndexEntry(key, ns.chunk_tokens, len(data), 0.0))
    return key


# --- configuration and keys --------------------------------------------------------------------


def test_config_field_env_and_normalisation() -> None:
    cfg = KVCloudConfig.from_env({"KVCLOUD_ENCRYPT_TENANTS": " b , a,,a "})
    assert cfg.encrypt_tenants == "a,b"
    assert cfg.encrypts("a") and cfg.encrypts("b") and not cfg.encrypts("c")
    assert not KVCloudConfig().encrypts("default")  # off unless asked for
    star = KVCloudConfig(encrypt_tenants="*")
    assert star.encrypts("anyone") and not star.encrypts("")
    assert KVCloudConfig(encrypt_tenants=["x", "*"]).encrypt_tenants == "*"  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        KVCloudConfig(encrypt_tenants=7)  # type: ignore[arg-type]


def test_keys_are_derived_per_tenant_and_ids_hide_the_tenant() -> None:
    a = derive_data_key(SECRET.encode(), TENANT)
    again = derive_data_key(SECRET.encode(), TENANT)
    b = derive_data_key(SECRET.encode(), "globex")
    other_secret = derive_data_key(b"another-secret", TENANT)
    assert a == again  # deterministic: every worker derives the same key
    assert len(a.enc_key) == 32 and a.enc_key != a.nonce_key
    assert len({a.enc_key, b.enc_key, other_secret.enc_key}) == 3
    assert len({a.key_id, b.key_id, other_secret.key_id}) == 3
    assert a.key_id == key_id(SECRET.encode(), TENANT)
    assert a.key_id.startswith("t:") and a.key_id.endswith(":v1") and len(a.key_id) == 21
    for part in ("acme", "corporation", TENANT):
        assert part not in a.key_id
    # nothing secret in the repr
    assert a.enc_key.hex() not in repr(a) and "enc_key" not in repr(a)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4"])
@pytest.mark.parametrize("dtype", DTYPE_CASES)
def test_round_trip_bit_exact_encrypted(backends: Backends, dtype: str, codec: str) -> None:
    ns = make_ns(dtype)
    c = ns.chunk_tokens
    n = 3 * c + 5
    toks, arr = make_tokens(n, seed=3), make_kv(ns, n, seed=3)
    with _open(backends, codec=codec) as kv:
        res = kv.push(ns, toks, arr, tenant=TENANT)
        assert res.pushed == 3 and res.objects_written == 3
        for data in _objects(kv).values():
            header, _ = read_header(data)
            assert header.encrypted and header.codec == codec
            assert header.key_id == kv.data_key(TENANT).key_id
            assert header.payload_len >= TAG_BYTES
        rec = kv.save_session(ns, "s-enc", toks, arr, tenant=TENANT)
    with _open(backends, codec=codec) as kv:
        m = kv.lookup(ns, toks, tenant=TENANT)
        assert m.tokens == 3 * c
        # strided destination: get + decode_segment
        assert same_bits(kv.pull(m), np.ascontiguousarray(arr[:, :, : 3 * c]))
        # contiguous pages: the streaming decoder decrypts straight into them
        pages = [np.zeros(ns.kv_shape(c), dtype=ns.dtype_info.storage) for _ in range(3)]
        got = kv.pull_into(m, pages)
        assert got.tokens == 3 * c and not got.failures
        for i, page in enumerate(pages):
            assert same_bits(page, np.ascontiguousarray(arr[:, :, i * c : (i + 1) * c]))
        # a session, partial tail and all
        loaded = kv.load_session(ns, "s-enc", tenant=TENANT)
        assert loaded.tail_key == rec.tail_key
        pulled = kv.pull_session(ns, loaded, tenant=TENANT)
        assert pulled.tokens == n and same_bits(pulled.array, arr) and not pulled.failures
        assert not kv.stats().get("verify_failures")


def test_stored_objects_hold_no_plaintext(backends: Backends) -> None:
    ns = make_ns(chunk_tokens=32)
    c = ns.chunk_tokens
    n = 2 * c + 9
    toks, arr = make_tokens(n, seed=8), pattern_kv(ns, n)
    plain = np.ascontiguousarray(arr).tobytes()
    for codec in ("raw", "zstd", "lz4"):
        ns = make_ns(chunk_tokens=32, revision=codec)  # fresh entries for each codec
        with _open(backends, codec=codec) as kv:
            kv.save_session(ns, f"s-{codec}", toks, arr, tenant=TENANT)
            objects = _objects(kv)
            assert len(objects) == 3  # two chunks and the tail
            stored = b"".join(objects.values())
            assert _leaked(plain, stored) == 0, codec
            # nor a shorter run: no 16-byte window either
            assert _leaked(plain, stored, 16) == 0, codec
            for key in objects:
                kv.store.delete(key)
    # the check itself works: the same KV of an unencrypted tenant is found at once
    with _open(backends) as kv:
        kv.push(ns, toks, arr, tenant="plain-tenant")
        assert _leaked(plain[: c * ns.bytes_per_token], b"".join(_objects(kv).values())) > 0


def _push_same(args: tuple[str, str, int]) -> tuple[int, bool]:
    store, index, _ = args
    ns = make_ns()
    toks, arr = make_tokens(6 * ns.chunk_tokens, seed=4), make_kv(ns, 6 * ns.chunk_tokens, seed=4)
    with KVCloud.open(store=store, index=index, secret=SECRET, encrypt_tenants=TENANT) as kv:
        res = kv.push(ns, toks, arr, tenant=TENANT)
        return res.objects_written, same_bits(kv.pull(kv.lookup(ns, toks, tenant=TENANT)), arr)


def test_equal_chunks_dedup_to_one_object(backends: Backends) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(6 * c, seed=4), make_kv(ns, 6 * c, seed=4)
    # two processes racing on the same prefix: deterministic encryption, one object each
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_push_same, [(backends.store, backends.index, i) for i in range(2)])
    assert all(ok for _, ok in results)
    with _open(backends) as kv:
        assert len(_objects(kv)) == 6 and kv.index.count_entries(ns.id) == 6
        # a third client, same chunks from a strided array, after the entries went away:
        # it re-creates exactly the same objects (same keys, nothing new written)
        keys = sorted(_objects(kv))
        for fp in kv.fingerprints(ns, toks, TENANT):
            kv.index.drop(ns.id, fp.hex())
        res = kv.push(ns, toks, np.concatenate([arr, arr], axis=2)[:, :, : 6 * c], TENANT)
        assert res.pushed == 6 and res.objects_written == 0 and sorted(res.keys) == keys
        assert sorted(_objects(kv)) == keys


# --- isolation and tampering --------------------------------------------------------------------


def test_another_tenant_cannot_find_or_decrypt(backends: Backends) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(2 * c, seed=5), make_kv(ns, 2 * c, seed=5)
    with _open(backends, encrypt=f"{TENANT},globex") as kv:
        res = kv.push(ns, toks, arr, tenant=TENANT)
        assert kv.lookup(ns, toks, tenant="globex").tokens == 0  # its fps differ
        m = kv.lookup(ns, toks, tenant=TENANT)
        # globex holding acme's exact entries (fps and object keys) still gets nothing
        stolen = type(m)(m.ns, "globex", m.chunks, m.prompt_chunks)
        got = kv.pull_detailed(stolen)
        assert got.tokens == 0
        assert {r for _, r in got.failures} == {"corrupt:DecryptionError"}
        # so does a tenant that does not encrypt, and the same tenant under another secret
        data = kv.store.get(res.keys[0])
        for key in (
            derive_data_key(SECRET.encode(), "default"),
            derive_data_key(b"another-secret", TENANT),
        ):
            with pytest.raises(DecryptionError):
                decode_segment(data, digest=content_digest(data), ns=ns, key=key)
        with pytest.raises(DecryptionError):
            decode_segment(data, ns=ns)  # no key at all


def _forge(kind: str, data: bytes, other: bytes, other_fp: tuple[bytes, bytes]) -> bytes:
    """A tampered version of ``data`` (an encrypted chunk) that still parses."""
    header, payload = _split(data)
    if kind == "ciphertext":
        p = bytearray(payload)
        p[len(p) // 2] ^= 0x01
        return _frame(header, bytes(p))
    if kind == "tag":
        p = bytearray(payload)
        p[-1] ^= 0x80
        return _frame(header, bytes(p))
    if kind == "nonce":
        nonce = bytearray(header["enc"]["nonce"])
        nonce[0] ^= 0x01
        header["enc"]["nonce"] = bytes(nonce)
        return _frame(header, payload)
    if kind == "key_id":
        header["enc"]["kid"] = key_id(SECRET.encode(), "globex")
        return _frame(header, payload)
    if kind == "replay":
        # another chunk's ciphertext, re-headered to claim this chunk's place in the chain:
        # every header check passes, only the AAD binding catches it
        h2, p2 = _split(other)
        h2["fp"], h2["parent"] = other_fp
        return _frame(h2, p2)
    if kind == "plaintext":
        # a well-formed unencrypted object with the right header (chosen KV injected)
        header["enc"] = {"alg": "none"}
        header["payload_len"] = header["raw_len"]
        return _frame(header, bytes(header["raw_len"]))
    raise AssertionError(kind)


TAMPER = ["ciphertext", "tag", "nonce", "key_id", "replay", "plaintext"]


@pytest.mark.parametrize("kind", TAMPER)
def test_tampering_in_place_is_a_digest_miss(backends: Backends, kind: str) -> None:
    """Bytes changed under the same key: the content address catches it first."""
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(3 * c, seed=6), make_kv(ns, 3 * c, seed=6)
    with _open(backends) as kv:
        res = kv.push(ns, toks, arr, tenant=TENANT)
        fps = kv.fingerprints(ns, toks, TENANT)
        data, other = kv.store.get(res.keys[1]), kv.store.get(res.keys[2])
        bad = _forge(kind, data, other, (fps[1], fps[0]))
        kv.store.delete(res.keys[1])
        kv.store.put(res.keys[1], bad)
        got = kv.pull_detailed(kv.lookup(ns, toks, tenant=TENANT))
        assert got.tokens == c and same_bits(got.array, arr[:, :, :c])
        assert got.failures == [(1, "corrupt:DigestMismatchError")]
        assert kv.stats()["verify_failures"] == 1 and kv.stats()["entries_dropped"] == 1


@pytest.mark.parametrize("path", ["pages", "array"])
@pytest.mark.parametrize("kind", TAMPER)
def test_tampered_object_under_its_own_digest_is_a_decryption_miss(
    backends: Backends, kind: str, path: str
) -> None:
    """The attacker re-stores the tampered object under its correct content address and
    rewrites the index entry: digest and header checks pass, the AEAD (tag, AAD, key id,
    encryption policy) must not."""
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(3 * c, seed=7), make_kv(ns, 3 * c, seed=7)
    with _open(backends) as kv:
        res = kv.push(ns, toks, arr, tenant=TENANT)
        fps = kv.fingerprints(ns, toks, TENANT)
        data, other = kv.store.get(res.keys[1]), kv.store.get(res.keys[2])
        bad = _forge(kind, data, other, (fps[1], fps[0]))
        forged_key = _point_entry_at(kv, ns, fps[1], bad)
        m = kv.lookup(ns, toks, tenant=TENANT)
        assert m.chunks[1].entry.object_key == forged_key
        if path == "pages":  # streaming decrypt into pages
            pages = [np.full(ns.kv_shape(c), 7, dtype=ns.dtype_info.storage) for _ in range(3)]
            got = kv.pull_into(m, pages)
            assert same_bits(pages[0], arr[:, :, :c])
        else:  # one strided array: get + decode
            got = kv.pull_detailed(m)
            assert same_bits(got.array, arr[:, :, :c])
        assert got.tokens == c
        assert got.failures == [(1, "corrupt:DecryptionError")]
        stats = kv.stats()
        assert stats["verify_failures"] == 1 and stats["entries_dropped"] == 1
        # the forged entry is gone; pushing again restores the real object
        assert kv.lookup(ns, toks, tenant=TENANT).tokens == c
        kv.push(ns, toks, arr, tenant=TENANT)
        assert same_bits(kv.pull(kv.lookup(ns, toks, tenant=TENANT)), arr)


def test_tampered_session_tail_costs_only_the_tail(backends: Backends) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(2 * c + 6, seed=9), make_kv(ns, 2 * c + 6, seed=9)
    with _open(backends) as kv:
        rec = kv.save_session(ns, "s-tail", toks, arr, tenant=TENANT)
        assert rec.tail_key is not None
        header, payload = _split(kv.store.get(rec.tail_key))
        p = bytearray(payload)
        p[3] ^= 0x04
        bad = _frame(header, bytes(p))
        bad_key = object_key(ns.id, content_digest(bad))
        kv.store.put(bad_key, bad)
        forged = dataclasses.replace(rec, tail_key=bad_key)
        pulled = kv.pull_session(ns, forged, tenant=TENANT)
        assert pulled.tokens == 2 * c and same_bits(pulled.array, arr[:, :, : 2 * c])
        assert pulled.failures == [(2, "tail")] and kv.stats()["verify_failures"] == 1


def test_every_flipped_byte_of_a_restored_object_is_refused() -> None:
    """Segment level, every byte position: flip it, recompute the digest (so only the AEAD
    and the header checks stand in the way), decode. Nothing may decode."""
    ns = make_ns(chunk_tokens=4)
    key = derive_data_key(SECRET.encode(), TENANT)
    kv = make_kv(ns, 4, seed=1)
    fp, parent = b"\x11" * 32, b"\x22" * 32
    seg = encode_segment(ns, fp, parent, kv, key=key)
    data = bytes(seg.data)
    _header, offset = read_header(data)
    kinds: dict[str, int] = {}
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        # a payload byte: the forger also rewrites the header's digest table (format 3)
        forged, digest = readdress(bad) if pos >= offset else (bytes(bad), content_digest(bad))
        with pytest.raises(CorruptObjectError) as exc:
            decode_segment(
                forged,
                digest=digest,
                ns=ns,
                fp=fp,
                parent=parent,
                key=key,
                require_encryption=True,
            )
        kinds[type(exc.value).__name__] = kinds.get(type(exc.value).__name__, 0) + 1
        if pos >= offset:  # ciphertext or tag: only the tag can tell
            assert isinstance(exc.value, DecryptionError)
    assert kinds.get("DecryptionError", 0) >= len(data) - offset


# --- unencrypted tenants, the encryption policy ------------------------------------------------


def test_unencrypted_tenants_keep_todays_exact_bytes(backends: Backends) -> None:
    ns = make_ns()
    toks, arr = make_tokens(2 * ns.chunk_tokens), make_kv(ns, 2 * ns.chunk_tokens)
    with _open(backends) as kv:
        res = kv.push(ns, toks, arr, tenant="plain-tenant")
        fps = kv.fingerprints(ns, toks, "plain-tenant")
        for i, key in enumerate(res.keys):
            c = ns.chunk_tokens
            want = encode_segment(ns, fps[i], [ns.digest, *fps][i], arr[:, :, i * c : (i + 1) * c])
            assert key == want.key() and kv.store.get(key) == bytes(want.data)
            assert read_header(kv.store.get(key))[0].encryption == {"alg": "none"}
        assert same_bits(kv.pull(kv.lookup(ns, toks, tenant="plain-tenant")), arr)


def test_encrypting_tenant_refuses_plaintext_and_heals(backends: Backends) -> None:
    """Objects pushed before the tenant turned encryption on are misses afterwards (they
    could have been planted); pushing again stores them encrypted."""
    ns = make_ns()
    toks, arr = make_tokens(2 * ns.chunk_tokens), make_kv(ns, 2 * ns.chunk_tokens)
    with _open(backends, encrypt="") as kv:
        kv.push(ns, toks, arr, tenant=TENANT)
    with _open(backends) as kv:
        got = kv.pull_detailed(kv.lookup(ns, toks, tenant=TENANT))
        assert got.tokens == 0 and got.failures[0] == (0, "corrupt:DecryptionError")
        res = kv.push(ns, toks, arr, tenant=TENANT)
        assert res.pushed == 2 and res.objects_written == 2
        assert same_bits(kv.pull(kv.lookup(ns, toks, tenant=TENANT)), arr)
    # and a client that no longer encrypts still reads what was encrypted
    with _open(backends, encrypt="") as kv:
        assert same_bits(kv.pull(kv.lookup(ns, toks, tenant=TENANT)), arr)


def test_secret_and_keys_never_appear_in_errors_or_logs(
    backends: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(2 * c), make_kv(ns, 2 * c)
    caplog.set_level(logging.DEBUG)
    messages: list[str] = []
    with _open(backends) as kv:
        res = kv.push(ns, toks, arr, tenant=TENANT)
        fps = kv.fingerprints(ns, toks, TENANT)
        data = kv.store.get(res.keys[1])
        for kind in TAMPER:
            bad = _forge(kind, data, kv.store.get(res.keys[0]), (fps[1], fps[0]))
            _point_entry_at(kv, ns, fps[1], bad)
            got = kv.pull_detailed(kv.lookup(ns, toks, tenant=TENANT))
            assert got.tokens == c
            messages += [r for _, r in got.failures]
            for key in (None, kv.data_key(TENANT), kv.data_key("globex")):
                try:
                    decode_segment(bad, ns=ns, key=key, require_encryption=True)
                except CorruptObjectError as exc:
                    messages += [str(exc), repr(exc)]
        dk = kv.data_key(TENANT)
        messages += [repr(kv), repr(kv.config), repr(dk), str(kv.stats())]
    messages += [r.getMessage() for r in caplog.records]
    text = "\n".join(messages)
    assert "DecryptionError" in text or "failed authentication" in text  # errors did happen
    for needle in (SECRET, SECRET.encode().hex(), dk.enc_key.hex(), dk.nonce_key.hex()):
        assert needle not in text


# --- the worker ---------------------------------------------------------------------------------


def test_worker_encrypts_per_tenant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVCLOUD_ENCRYPT_TENANTS reaches the worker's client; uploads and flushes carry the
    request's tenant, so acme's pages are sealed and default's are not, and a second worker
    restores acme's session."""
    pytest.importorskip("torch")
    from workers.config import WorkerOptions
    from workers.engine import CompletionRequest, Engine

    monkeypatch.setenv("KVCLOUD_ENCRYPT_TENANTS", "acme")
    opts = dict(
        model="tiny",
        cache_pages=32,
        chunk_tokens=16,
        store=f"file://{tmp_path / 'objects'}",
        index=f"sqlite://{tmp_path / 'index.db'}",
        write_policy="write-through",
    )

    def req(tokens: list[int], tenant: str, **kw: object) -> CompletionRequest:
        return CompletionRequest(
            prompt_tokens=tokens, max_tokens=3, stop_at_eos=False, tenant=tenant, **kw
        )

    rng = np.random.default_rng(0)
    p_acme = [int(x) for x in rng.integers(0, 256, 40)]
    p_default = [int(x) for x in rng.integers(0, 256, 40)]
    a = Engine(WorkerOptions(**opts))  # type: ignore[arg-type]
    try:
        sid = a.create_session("acme")
        first = a.complete(req(p_acme, "acme", session_id=sid))
        a.complete(req(p_default, "default"))
        assert a.uploader is not None and a.uploader.drain(10)
        a.flush_session(sid, "acme")
        assert a.kv is not None
        acme_kid = a.kv.data_key("acme").key_id
        kinds = {read_header(a.kv.store.get(i.key))[0].key_id for i in a.kv.store.list()}
        assert kinds == {acme_kid, None}
    finally:
        a.close()
    b = Engine(WorkerOptions(**opts))  # type: ignore[arg-type]
    try:
        r = b.complete(req([1, 2, 3], "acme", session_id=sid))
        assert r.tokens_remote > 0 and first.tokens
        assert b.kv is not None and not b.kv.stats().get("verify_failures")
    finally:
        b.close()


# --- the bench ----------------------------------------------------------------------------------


def test_bench_store_reports_encryption_overhead(tmp_path: Path) -> None:
    from kvcloud.tools.bench import BenchLayout, run_store_bench

    r = run_store_bench(
        f"file://{tmp_path / 'o'}",
        f"sqlite://{tmp_path / 'i.db'}",
        layout=BenchLayout.resolve("tiny", chunk_tokens=16),
        chunks=4,
        repeat=2,
        pull_passes=2,
        lookup_chunks=8,
        lookup_iters=5,
        encrypt=True,
    )
    enc = r["encryption"]
    assert enc["alg"] == ALG
    for op in ("push", "pull", "pull_array"):
        pair = enc[op]
        assert pair["kvcloud"]["gbps_best"] > 0 and pair["baseline"]["gbps_best"] > 0
        assert pair["ratio_best"] == pytest.approx(
            pair["kvcloud"]["gbps_best"] / pair["baseline"]["gbps_best"]
        )
        # one push per round, two pulls of each kind per round
        assert len(pair["kvcloud"]["seconds"]) == (2 if op == "push" else 4)
    assert enc["object_bytes"] > r["layout"]["object_bytes"]  # the tag rides along
    assert "error" not in r["cleanup"]
    with KVCloud.open(
        store=f"file://{tmp_path / 'o'}", index=f"sqlite://{tmp_path / 'i.db'}"
    ) as kv:
        assert list(kv.store.list()) == [] and list(kv.index.iter_entries()) == []
