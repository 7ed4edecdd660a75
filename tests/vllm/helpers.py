"""Comparisons against the no-connector reference."""

from __future__ import annotations

from typing import Any

from scripts.vllm_fleet import completion_ids, connector_namespace, wait_stored

__all__ = [
    "LOGPROB_DIFFS",
    "assert_same_answer",
    "connector_namespace",
    "objects_per_chunk",
    "restore_and_compare",
    "wait_stored",
]

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


def restore_and_compare(server: Any, ref: Any, prompt: list[int], least: int, label: str) -> None:
    """``server`` answers ``prompt`` restoring at least ``least`` tokens from kvcloud (its
    ``loaded_tokens`` counter, summed over its ranks), with the greedy answer of ``ref`` (no
    connector, same TP size)."""
    before = server.metrics().get("loaded_tokens", 0)
    got = server.complete(prompt, max_tokens=16)
    assert server.metrics().get("loaded_tokens", 0) - before >= least, label
    assert_same_answer(got, ref.complete(prompt, max_tokens=16), label)


def objects_per_chunk(store: dict[str, str], ns: Any, tokens: list[int]) -> list[int]:
    """How many objects (parts) each stored chunk of ``tokens`` names, by a plain lookup."""
    from kvcloud import KVCloud

    with KVCloud.open(
        store=store["KVCLOUD_STORE"], index=store["KVCLOUD_INDEX"], secret=store["KVCLOUD_SECRET"]
    ) as k:
        return [len(ref.entry.keys) for ref in k.lookup(ns, tokens).chunks]
