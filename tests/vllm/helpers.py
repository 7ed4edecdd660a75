"""Comparisons against the no-connector reference."""

from __future__ import annotations

from typing import Any

from scripts.fleet.vllm_fleet import completion_ids, connector_namespace, wait_stored

__all__ = [
    "LOGPROB_BOUND",
    "LOGPROB_DIFFS",
    "assert_same_answer",
    "connector_namespace",
    "objects_per_chunk",
    "plant_kv",
    "restore_and_compare",
    "wait_stored",
]

# largest difference seen between a restored and a recomputed prefill's token logprobs, per
# test (reported; LOGPROB_BOUND is asserted)
LOGPROB_DIFFS: dict[str, float] = {}

# the most an answer's token logprobs may differ from the reference's (docs/VLLM.md says why):
# every restore measured so far stays at 3.3e-5 or less, and the deliberately wrong restores
# of test_production.py's negative control differ by far more
LOGPROB_BOUND = 1e-4


def token_logprobs(resp: dict[str, Any]) -> list[float]:
    lp = resp["choices"][0].get("logprobs") or {}
    return [float(x) for x in lp.get("token_logprobs") or []]


def assert_same_answer(
    got: dict[str, Any], ref: dict[str, Any], label: str, bound: float = LOGPROB_BOUND
) -> float:
    """Identical greedy tokens, and each token's logprob within ``bound`` of the reference's;
    returns (and records) the largest logprob difference."""
    ids = completion_ids(got)
    assert ids == completion_ids(ref), f"{label}: {ids} != reference {completion_ids(ref)}"
    a, b = token_logprobs(got), token_logprobs(ref)
    assert len(a) == len(b) == len(ids), f"{label}: logprobs missing ({len(a)}, {len(b)})"
    diff = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    LOGPROB_DIFFS[label] = diff
    print(f"{label}: greedy tokens identical; largest token logprob difference {diff:.2e}")
    assert diff <= bound, (
        f"{label}: greedy tokens identical, but token logprobs differ from the reference's "
        f"by {diff:.2e} > {bound:.0e}"
    )
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


def corrupt_chunk(store: dict[str, str], ns: Any, tokens: list[int], position: int) -> None:
    """Flip one bit in the last layer of the object of chunk ``position`` of ``tokens``
    (found by a plain lookup), so the chunk fails verification when it is pulled."""
    from kvcloud import KVCloud

    with KVCloud.open(
        store=store["KVCLOUD_STORE"], index=store["KVCLOUD_INDEX"], secret=store["KVCLOUD_SECRET"]
    ) as k:
        key = k.lookup(ns, tokens).chunks[position].entry.object_key
        data = bytearray(k.store.get(key))
        data[-100] ^= 0x01
        k.store.delete(key)
        k.store.put(key, bytes(data))


def plant_kv(
    store: dict[str, str], victim: list[int], donor: list[int], tenant: str = "default"
) -> int:
    """A deliberately wrong restore, for negative controls: the KV of ``donor``'s stored full
    chunks (plain SmolLM2's namespace) stored under ``victim``'s fingerprints, as a broken key
    or a swapped index entry would serve it. Every object is well formed and verifies: only
    the answer can tell. Returns the chunks planted (those ``victim`` shares with ``donor``,
    same prefix, same key, are already stored, and right)."""
    from kvcloud import KVCloud

    ns = connector_namespace()
    with KVCloud.open(
        store=store["KVCLOUD_STORE"], index=store["KVCLOUD_INDEX"], secret=store["KVCLOUD_SECRET"]
    ) as k:
        kv = k.pull(k.lookup(ns, donor, tenant))
        n = min(kv.shape[2], len(victim) // ns.chunk_tokens * ns.chunk_tokens)
        return k.push(ns, victim[:n], kv[:, :, :n], tenant).pushed
