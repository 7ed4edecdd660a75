from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcloud import ConfigError, LayoutError, Namespace, chunk_fingerprints, derive_tenant_key
from kvcloud.namespace import tail_fingerprint
from tests.helpers import make_ns, make_tokens

SCRIPT = """
import json, sys
import numpy as np
from kvcloud import Namespace, chunk_fingerprints, derive_tenant_key
ns = Namespace(model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=8,
               chunk_tokens=16)
toks = np.arange(100) * 7919 % 50000
fps = chunk_fingerprints(ns, toks, derive_tenant_key(b"secret", "acme"))
print(json.dumps([ns.id] + [f.hex() for f in fps]))
"""


def _run(seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def test_fingerprints_identical_across_processes_and_hash_seeds() -> None:
    a, b = _run("1"), _run("12345")
    assert a == b
    ns = Namespace(
        model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=16
    )
    local = chunk_fingerprints(
        ns, np.arange(100) * 7919 % 50000, derive_tenant_key(b"secret", "acme")
    )
    assert a == [ns.id] + [f.hex() for f in local]
    assert len(a) == 1 + 100 // 16


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "r2"},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_dim": 16},
        {"dtype": "bfloat16"},
        {"chunk_tokens": 32},
        {"extra": "rope-scaling=2"},
    ],
)
def test_every_field_changes_namespace_and_fingerprints(change: dict) -> None:
    base = make_ns()
    other = dataclasses.replace(base, **change)
    assert other.id != base.id
    toks = make_tokens(64)
    key = derive_tenant_key(b"s", "t")
    fa = chunk_fingerprints(base, toks, key)
    fb = chunk_fingerprints(other, toks, key)
    assert not set(fa) & set(fb)


def test_tenants_and_secrets_give_disjoint_fingerprints() -> None:
    ns = make_ns()
    toks = make_tokens(64)
    fa = chunk_fingerprints(ns, toks, derive_tenant_key(b"s", "a"))
    fb = chunk_fingerprints(ns, toks, derive_tenant_key(b"s", "b"))
    fc = chunk_fingerprints(ns, toks, derive_tenant_key(b"s2", "a"))
    assert not set(fa) & set(fb)
    assert not set(fa) & set(fc)


def test_chain_depends_on_every_earlier_token() -> None:
    ns = make_ns()
    key = derive_tenant_key(b"s", "t")
    toks = make_tokens(64)
    changed = toks.copy()
    changed[3] += 1
    fa, fb = chunk_fingerprints(ns, toks, key), chunk_fingerprints(ns, changed, key)
    assert all(x != y for x, y in zip(fa, fb, strict=True))
    # a change in chunk 2 leaves chunks 0 and 1 shared
    changed2 = toks.copy()
    changed2[40] += 1
    fc = chunk_fingerprints(ns, changed2, key)
    assert fa[:2] == fc[:2] and fa[2:] != fc[2:]


def test_only_full_chunks_and_list_equals_array() -> None:
    ns = make_ns()
    key = derive_tenant_key(b"s", "t")
    toks = make_tokens(47)
    assert len(chunk_fingerprints(ns, toks, key)) == 2
    assert chunk_fingerprints(ns, toks.tolist(), key) == chunk_fingerprints(ns, toks, key)
    assert chunk_fingerprints(ns, [], key) == []


def test_chain_matches_the_formula_computed_with_hashlib() -> None:
    # DESIGN §2, written out with hashlib alone: fp_0 = ns digest,
    # fp_i = keyed BLAKE2b-256(fp_{i-1} ‖ chunk i as little-endian uint32).
    ns = make_ns()
    key = derive_tenant_key(b"s", "t")
    toks = np.random.default_rng(5).integers(0, 2**32, 5 * ns.chunk_tokens + 3, dtype=np.int64)
    expected, parent = [], ns.digest
    for i in range(5):
        chunk = struct.pack(
            f"<{ns.chunk_tokens}I", *toks[i * ns.chunk_tokens : (i + 1) * ns.chunk_tokens]
        )
        parent = hashlib.blake2b(
            parent + chunk, digest_size=32, key=key, person=b"kvc-fp-v1"
        ).digest()
        expected.append(parent)
    assert chunk_fingerprints(ns, toks, key) == expected
    # A strided view (every other token of a longer array) hashes its values, not its memory.
    wide = np.repeat(toks.astype("<u4"), 2)
    assert chunk_fingerprints(ns, wide[::2], key) == expected


def test_tail_fingerprint_differs_from_chunk() -> None:
    ns = make_ns()
    key = derive_tenant_key(b"s", "t")
    toks = make_tokens(20)
    fps = chunk_fingerprints(ns, toks, key)
    t = tail_fingerprint(ns, fps[0], toks[16:], key)
    assert t not in fps
    with pytest.raises(LayoutError):
        tail_fingerprint(ns, fps[0], toks[:16], key)


@pytest.mark.parametrize("bad", [[-1, 2], [2**32], [[1, 2]], [1.5, 2.0]])
def test_bad_tokens_rejected(bad: list) -> None:
    with pytest.raises(LayoutError):
        chunk_fingerprints(make_ns(), np.asarray(bad), derive_tenant_key(b"s", "t"))


@pytest.mark.parametrize(
    "kw",
    [
        {"num_layers": 0},
        {"head_dim": -1},
        {"dtype": "float64"},
        {"chunk_tokens": 0},
        {"model": ""},
        {"format_version": 99},
    ],
)
def test_invalid_namespace_is_config_error(kw: dict) -> None:
    with pytest.raises(ConfigError):
        make_ns(**kw)


def test_bytes_per_token_is_seed_formula() -> None:
    ns = Namespace(model="small", num_layers=12, num_kv_heads=4, head_dim=64)
    assert ns.bytes_per_token == 12 * 2 * 4 * 64 * 2 == 12 * 1024
    assert ns.chunk_bytes == 256 * 12 * 1024


def test_tenant_key_requires_secret_and_tenant() -> None:
    with pytest.raises(ConfigError):
        derive_tenant_key(b"", "t")
    with pytest.raises(ConfigError):
        derive_tenant_key(b"s", "")


def test_the_clients_tenant_key_cache_is_bounded(tmp_path: Path) -> None:
    """One scope per cache_salt or adapter: the derived keys kept are bounded (LRU), and a
    key derived again after being forgotten is the same key."""
    from kvcloud import KVCloud
    from kvcloud.client import base

    with KVCloud.open(
        store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s"
    ) as kvc:
        first = kvc.tenant_key("t0")
        for i in range(base.KEY_CACHE_SIZE + 10):
            kvc.tenant_key(f"t{i}")
            kvc.data_key(f"t{i}")
        assert len(kvc._keys) == base.KEY_CACHE_SIZE
        assert len(kvc._data_keys) == base.KEY_CACHE_SIZE
        assert "t0" not in kvc._keys
        assert kvc.tenant_key("t0") == first
