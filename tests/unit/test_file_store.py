"""FileStore specifics: cross-process create-only puts, fsync, temp files, file:// URLs."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvcloud.errors import ConfigError, StoreError
from kvcloud.stores import FileStore, open_store
from kvcloud.stores.file import TMP_PREFIX

SHARED_KEY = "ns/ab/shared-object"


def _shared_payload() -> bytes:
    # Big enough that writes overlap in time; every process derives the same bytes.
    return random.Random(42).randbytes(4 << 20)


def _put_from_process(root: str, barrier: Any, results: Any) -> None:
    store = FileStore(root)
    data = _shared_payload()
    barrier.wait(30)
    try:
        results.put(store.put(SHARED_KEY, data))
    except BaseException as exc:  # reported, so the parent's assertion shows it
        results.put(repr(exc))


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


def test_processes_racing_on_one_key(tmp_path: Path) -> None:
    n = 8
    root = tmp_path / "store"
    ctx = multiprocessing.get_context("spawn")  # no inherited state, like separate workers
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_put_from_process, args=(str(root), barrier, results)) for _ in range(n)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(outcomes, key=repr) == [False] * (n - 1) + [True], outcomes
    assert FileStore(root).get(SHARED_KEY) == _shared_payload()
    assert temp_files(root) == []


@pytest.mark.parametrize("fsync", [False, True])
def test_fsync_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    store = FileStore(tmp_path / "s", fsync=fsync)
    assert store.put("a/b/c", b"durable") is True
    assert store.get("a/b/c") == b"durable"
    if fsync:
        # the file, its directory, and the parents of the two new directories a/ and a/b/
        assert len(synced) >= 4
    else:
        assert synced == []
    synced.clear()
    assert store.put("a/b/c", b"durable") is False
    assert synced == []  # nothing written, nothing to sync
    assert temp_files(tmp_path) == []


def test_root_is_created_and_url_is_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = FileStore("rel/objects")
    assert (tmp_path / "rel" / "objects").is_dir()
    assert store.url == f"file://{tmp_path}/rel/objects"
    assert repr(store) == f"FileStore('file://{tmp_path}/rel/objects')"


def test_root_that_is_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StoreError):
        FileStore(tmp_path / "f")


def test_objects_land_under_the_root(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    store.put("ns/ab/cd", b"x")
    assert (tmp_path / "s" / "ns" / "ab" / "cd").read_bytes() == b"x"


def test_invalid_keys_touch_nothing_outside(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    for key in ["../escape", "/tmp/escape", "a/../../escape", "a//b"]:
        with pytest.raises(StoreError):
            store.put(key, b"evil")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert list((tmp_path / "s").iterdir()) == []
    with pytest.raises(StoreError):
        list(store.list("../"))


def test_temp_names_are_reserved_and_hidden(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    with pytest.raises(StoreError, match="reserved"):
        store.put(f"ns/{TMP_PREFIX}x", b"x")
    store.put("ns/real", b"x")
    (tmp_path / "s" / "ns" / f"{TMP_PREFIX}123-abc").write_bytes(b"half-written")
    assert [i.key for i in store.list()] == ["ns/real"]


def test_link_failure_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path / "s")

    def broken_link(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "link", broken_link)
    with pytest.raises(StoreError, match="I/O error"):
        store.put("k", b"x")
    assert store.head("k") is None
    assert temp_files(tmp_path) == []


def test_filesystem_without_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path / "s")

    def no_links(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    assert store.put("k", b"x") is True  # falls back to an atomic rename
    assert store.get("k") == b"x"
    assert temp_files(tmp_path) == []


def test_directory_in_place_of_an_object(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    store.put("a/b", b"x")
    assert store.head("a") is None
    with pytest.raises(StoreError):
        store.put("a", b"y")
    with pytest.raises(StoreError):
        store.put("a/b/c", b"z")  # a/b is a file


def test_head_mtime_is_the_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    store.put("k", b"12345")
    os.utime(tmp_path / "s" / "k", (1_700_000_000, 1_700_000_000))
    info = store.head("k")
    assert info is not None and info.size == 5 and info.last_modified == 1_700_000_000


# -- open_store(file://) --------------------------------------------------------------------------


def test_open_store_absolute(tmp_path: Path) -> None:
    with open_store(f"file://{tmp_path}/abs", max_workers=1) as store:
        assert isinstance(store, FileStore)
        assert store.root == tmp_path / "abs"
        assert store.max_workers == 1
        assert store.fsync is False


def test_file_store_threads_follow_the_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # page-cache reads and writes are CPU work: no more threads than CPUs (at least 2),
    # never more than max_workers, unless the URL asks for a number
    import kvcloud.stores as stores

    for cpus, max_workers, want in ((2, 16, 2), (1, 16, 2), (8, 16, 8), (64, 16, 16), (8, 4, 4)):
        monkeypatch.setattr(stores, "_usable_cpus", lambda n=cpus: n)
        with open_store(f"file://{tmp_path}", max_workers=max_workers) as store:
            assert store.max_workers == want, (cpus, max_workers)
    with open_store(f"file://{tmp_path}?threads=32", max_workers=4) as store:
        assert store.max_workers == 32


def test_open_store_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with open_store("file://rel/dir") as store:
        assert isinstance(store, FileStore)
        assert store.root == tmp_path / "rel" / "dir"


def test_open_store_fsync(tmp_path: Path) -> None:
    assert open_store(f"file://{tmp_path}", fsync=True).fsync is True  # type: ignore[attr-defined]
    assert open_store(f"file://{tmp_path}?fsync=1").fsync is True  # type: ignore[attr-defined]
    url = f"file://{tmp_path}?fsync=false"
    assert open_store(url, fsync=True).fsync is False  # type: ignore[attr-defined]


def test_open_store_percent_decodes(tmp_path: Path) -> None:
    with open_store(f"file://{tmp_path}/with%20space") as store:
        assert store.root == tmp_path / "with space"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("/var/lib/kvcloud", "file://"),
        ("relative/dir", "file://"),
        ("gopher://host/x", "s3://"),
        ("file://", "no directory"),
        ("file:///tmp/x?bogus=1", "bogus"),
        ("file:///tmp/x?fsync=perhaps", "fsync"),
        ("file:///tmp/x?threads=0", "threads"),
        ("file:///tmp/x?threads=many", "threads"),
    ],
)
def test_open_store_config_errors(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        open_store(url)
