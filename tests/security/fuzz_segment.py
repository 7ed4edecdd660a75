"""atheris (coverage-guided libFuzzer) target for the segment decoder.

Every input goes through ``decode_segment`` (without and with a namespace, as a store reader
would call it) and ``read_segment_into`` (the streaming path). The only exceptions allowed are
``KVCloudError`` subclasses; anything else - an IndexError from a short buffer, a numpy
ValueError, a MemoryError, a zstd or msgpack exception that escaped - is a crash. Memory is
bounded twice: libFuzzer's ``-rss_limit_mb`` for the process, and a per-input ``tracemalloc``
peak for the namespace-bound paths, which must never allocate much more than the input and the
one segment the namespace allows.

atheris.Fuzz() ends the process, so tests run this as a subprocess
(tests/security/test_segment_fuzz.py). By hand::

    python -m tests.security.fuzz_segment -runs=100000 -rss_limit_mb=1024 [CORPUS_DIR]

Seeds (valid objects in every codec, and an encrypted one where the format supports it) are
written to a fresh corpus directory when none is given, so mutation starts past the magic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import atheris
import numpy as np

# Only kvcloud gets coverage instrumentation: numpy and the codecs would slow every run and
# guide the fuzzer into their internals instead of our parser.
with atheris.instrument_imports(include=["kvcloud.segment", "kvcloud.crypto"]):
    from kvcloud import segment
    from kvcloud.errors import KVCloudError
    from kvcloud.namespace import Namespace, chunk_fingerprints, derive_tenant_key

NS = Namespace(
    model="fuzz-model",
    revision="r1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float16",
    chunk_tokens=16,
)
SEGMENT_BYTES = int(np.prod(NS.kv_shape(NS.chunk_tokens))) * NS.dtype_info.itemsize
# slack for the header, msgpack, hashing buffers and small Python objects
MEMORY_SLACK = 1 << 20


def _data_key() -> Any:
    """A tenant data key where this version of kvcloud encrypts segments, else None."""
    try:
        from kvcloud.crypto import derive_data_key
    except ImportError:
        return None
    return derive_data_key(b"fuzz-master-secret", "fuzz-tenant")


KEY = _data_key()
_accepts_key = "key" in inspect.signature(segment.decode_segment).parameters
KEYWORDS: dict[str, Any] = {"key": KEY} if KEY is not None and _accepts_key else {}


def seeds() -> list[bytes]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=32)
    fps = chunk_fingerprints(NS, tokens, derive_tenant_key(b"fuzz", "t"))
    full = rng.standard_normal(NS.kv_shape(16)).astype(np.float16)
    out = []
    lossy = getattr(segment, "LOSSY_CODECS", ())
    for codec in segment.CODECS:
        # a lossy codec encodes only in a namespace that names it
        ns = dataclasses.replace(NS, quant=codec) if codec in lossy else NS
        for n in (16, 5):  # a full chunk and a partial tail
            kv = np.ascontiguousarray(full[:, :, :n])
            out.append(bytes(segment.encode_segment(ns, fps[1], fps[0], kv, codec=codec).data))
    if KEYWORDS:
        seg = segment.encode_segment(NS, fps[1], fps[0], full, codec="zstd", **KEYWORDS)
        out.append(bytes(seg.data))
    return out


def _bounded(data: bytes, fn: Any) -> None:
    """Run fn, allowing only KVCloudError, and fail if it allocated past the bound."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    with contextlib.suppress(KVCloudError):
        fn()
    peak = tracemalloc.get_traced_memory()[1] - before
    limit = 2 * len(data) + 4 * SEGMENT_BYTES + MEMORY_SLACK
    if peak > limit:
        raise MemoryError(f"decoding {len(data)} bytes allocated {peak} bytes (limit {limit})")


def test_one_input(data: bytes) -> None:
    # Without a namespace the decoder's own cap (MAX_UNBOUND_RAW_LEN) is the bound;
    # -rss_limit_mb enforces it.
    with contextlib.suppress(KVCloudError):
        segment.decode_segment(data, **KEYWORDS)
    out = np.empty(NS.kv_shape(NS.chunk_tokens), dtype=np.dtype(NS.dtype_info.storage))
    _bounded(data, lambda: segment.decode_segment(data, ns=NS, **KEYWORDS))
    _bounded(data, lambda: segment.decode_segment(data, ns=NS, out=out, **KEYWORDS))
    _bounded(data, lambda: segment.read_segment_into(io.BytesIO(data), out, ns=NS, **KEYWORDS))


def main(argv: list[str]) -> None:
    if not any(not a.startswith("-") for a in argv[1:]):  # no corpus directory given
        corpus = Path(tempfile.mkdtemp(prefix="kvcloud-fuzz-corpus-"))
        for i, seed in enumerate(seeds()):
            (corpus / f"seed-{i}").write_bytes(seed)
        argv = [*argv, str(corpus)]
    tracemalloc.start()
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
