"""Comparisons against the no-connector reference."""

from __future__ import annotations

from typing import Any

from scripts.vllm_fleet import completion_ids

# largest difference seen between a restored and a recomputed prefill's token logprobs, per
# test: reported, not asserted on (identical greedy tokens is the requirement)
LOGPROB_DIFFS: dict[str, float] = {}


def token_logprobs(resp: dict[str, Any]) -> list[float]:
    lp = resp["choices"][0].get("logprobs") or {}
    return [float(x) for x in lp.get("token_logprobs") or []]


def assert_same_answer(got: dict[str, Any], ref: dict[str, Any], label: str) -> float:
    """Identical greedy tokens; returns (and records) the largest logprob difference."""
    assert completion_ids(got) == completion_ids(ref), (
        f"{label}: {completion_ids(got)} != reference {completion_ids(ref)}"
    )
    a, b = token_logprobs(got), token_logprobs(ref)
    diff = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    LOGPROB_DIFFS[label] = diff
    print(f"{label}: greedy tokens identical; largest token logprob difference {diff:.2e}")
    return diff


def connector_namespace(model_dir: Any = None, dtype: str = "float32", chunk: int = 256) -> Any:
    """The namespace the connector derives for SmolLM2 served in ``dtype``, built here from
    its definition (tests compare it with the id the server logs)."""
    import json

    from kvcloud import Namespace
    from kvcloud.integrations.vllm.keys import checkpoint_digest
    from scripts.vllm_fleet import SMOLLM2

    return Namespace(
        model="vllm/llama",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        revision=checkpoint_digest(str(model_dir or SMOLLM2)),
        dtype=dtype,
        chunk_tokens=chunk,
        extra=json.dumps(
            {"compute_dtype": dtype, "layout": "vllm-kv-v1", "quantization": "None"},
            sort_keys=True,
        ),
    )


def wait_stored(
    env: dict[str, str], prompt: list[int], tenant: str = "default", timeout: float = 30.0
) -> int:
    """Wait until the background uploader has registered every full chunk of ``prompt``
    (pushes are asynchronous); returns how many are indexed."""
    import time

    from kvcloud import KVCloud

    ns = connector_namespace()
    deadline = time.monotonic() + timeout
    with KVCloud.open(
        store=env["KVCLOUD_STORE"], index=env["KVCLOUD_INDEX"], secret=env["KVCLOUD_SECRET"]
    ) as k:
        fps = k.fingerprints(ns, prompt, tenant)
        while True:
            try:
                found = sum(e is not None for e in k.index.lookup(ns.id, [f.hex() for f in fps]))
            except Exception:
                found = 0
            if found == len(fps) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)
