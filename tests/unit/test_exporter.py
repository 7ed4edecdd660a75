"""What the exporter serves from the index's bookkeeping (kvcloud/tools/exporter.py): the same
figures as a full scan where they are exact, estimates labelled as such, the sample's
histograms, and the optional listing of the store on its own clock."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcloud import KVCloud
from kvcloud.indexes import IndexEntry, SQLiteIndex
from kvcloud.tools.cli.stats import collect_stats, collect_summary, list_store
from kvcloud.tools.exporter import StatsExporter, prometheus_text, summarize_sample
from tests.helpers import make_kv, make_ns, make_tokens


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.fixture
def pushed(tmp_path: Path) -> argparse.Namespace:
    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}"
    ns = make_ns()
    with KVCloud.open(store=store, index=index) as kv:
        for seed in (1, 2, 3):
            kv.push(ns, make_tokens(40, seed=seed), make_kv(ns, 40, seed=seed))
        kv.pull(kv.lookup(ns, make_tokens(40, seed=1)))
    return argparse.Namespace(store=store, index=index, no_store=False)


def test_summary_figures_equal_the_full_scan_and_estimates_say_so(
    pushed: argparse.Namespace,
) -> None:
    full = collect_stats(pushed, show=False)
    summary = collect_summary(pushed, 512)
    for key in ("entries", "entry_bytes", "tokens", "sessions", "namespaces", "counters"):
        assert summary[key] == full[key], key
    # one object per entry here, so the estimate is exact; it is labelled all the same
    assert summary["objects_estimate"] == full["objects"] == 6
    assert summary["object_bytes_estimate"] == full["object_bytes"]
    samples = _samples(prometheus_text(summary))
    (ns,) = summary["namespaces"]
    assert samples[("kvcloud_index_entries", (("ns", ns),))] == 6
    assert samples[("kvcloud_index_sessions", ())] == 0
    assert samples[("kvcloud_store_objects", (("estimate", "true"),))] == 6
    assert ("kvcloud_store_objects", ()) not in samples
    assert samples[("kvcloud_index_sample_age_seconds_count", (("ns", ns),))] == 6
    assert samples[("kvcloud_index_sample_entry_bytes_count", (("ns", ns),))] == 6
    assert samples[("kvcloud_index_sample_idle_seconds_bucket", (("le", "60.0"), ("ns", ns)))] == 6
    # the one-shot full scan keeps its unlabelled, exact store figures
    assert ("kvcloud_store_objects", ()) in _samples(prometheus_text(full))


def test_summarize_sample_histograms() -> None:
    from kvcloud.indexes.base import EntryRecord

    now = 10_000.0
    recs = [
        EntryRecord("a", "f1", IndexEntry("k1", 256, 5000, now - 30), now + 100 - 10),
        EntryRecord("a", "f2", IndexEntry.of_parts(["x", "y"], 256, 9000, now - 7200), None),
    ]
    got = summarize_sample(recs, ttl_seconds=100, now=now)["a"]
    assert got["entries"] == 2 and got["objects_per_entry"] == 1.5
    age = dict(got["age_seconds"]["buckets"])
    assert age[60] == 1 and age[3600] == 1 and age[4 * 3600] == 2
    assert got["idle_seconds"]["count"] == 1 and got["idle_seconds"]["sum"] == pytest.approx(10)
    assert dict(got["entry_bytes"]["buckets"])[16384] == 2


def test_store_estimate_counts_parts(tmp_path: Path) -> None:
    """An entry naming its chunk's parts (tensor-parallel writers) counts each part."""
    index = f"sqlite://{tmp_path / 'i.db'}"
    with SQLiteIndex(tmp_path / "i.db") as idx:
        for i in range(4):
            keys = [f"segments/p{i}-{j}" for j in range(4)]
            idx.register("ns1", f"{i:064x}", IndexEntry.of_parts(keys, 256, 4000, 1.0))
    result = collect_summary(argparse.Namespace(store=None, index=index, no_store=False), 512)
    assert result["entries"] == 4 and result["objects_estimate"] == 16


def test_listing_on_its_own_clock_replaces_the_estimates(pushed: argparse.Namespace) -> None:
    listed: list[object] = [list_store(pushed), OSError("store down")]

    def lister() -> dict:  # type: ignore[type-arg]
        r = listed.pop(0)
        if isinstance(r, Exception):
            raise r
        return r  # type: ignore[return-value]

    exp = StatsExporter(
        lambda: collect_summary(pushed, 16), 60, list_store=lister, list_interval=3600
    )
    assert exp.scan_once()
    before = _samples(generate_latest(exp.registry).decode())
    assert before[("kvcloud_store_objects", (("estimate", "true"),))] == 6
    assert before[("kvcloud_stats_store_list_failures_total", ())] == 0
    assert exp.list_once() and not exp.list_once()
    after = _samples(generate_latest(exp.registry).decode())
    assert after[("kvcloud_store_objects", ())] == 6  # listed: exact, no label
    assert ("kvcloud_store_objects", (("estimate", "true"),)) not in after
    assert after[("kvcloud_stats_store_list_failures_total", ())] == 1
    assert after[("kvcloud_stats_store_list_seconds", ())] >= 0


def test_list_store_every_needs_a_positive_interval() -> None:
    from kvcloud.errors import KVCloudError

    with pytest.raises(KVCloudError, match="list-store-every"):
        StatsExporter(dict, 60, list_store=dict, list_interval=0)
