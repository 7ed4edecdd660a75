"""The behaviour every ObjectStore must have, written once (DESIGN §6).

Subclass ``StoreContract`` in a ``test_*.py`` module and provide a ``store`` fixture that
yields an empty store; pytest then runs every test here against that backend. Capability
flags describe what a backend cannot promise, so the same tests stay strict elsewhere.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from kvcloud.errors import ObjectNotFoundError, StoreError
from kvcloud.stores.base import ObjectStore

MiB = 1 << 20

INVALID_KEYS = ["../x", "/abs", "a//b", "a/../b", "", "a/./b", "trailing/", "sp ace", "x\x00y"]


def payload(size: int, seed: int = 0) -> bytes:
    # Random bytes, so a backend that transcodes, truncates or pads is caught bit-exactly.
    return random.Random(seed * 1_000_003 + size).randbytes(size)


class StoreContract:
    """Tests for one ObjectStore backend. Subclasses override the ``store`` fixture."""

    #: put() of an existing key returns False and leaves the object alone. False for
    #: backends that cannot tell (an S3 server ignoring If-None-Match just overwrites).
    detects_existing: ClassVar[bool] = True

    #: Concurrent puts of one absent key make exactly one of them return True. False
    #: for backends whose existence check and write are not one atomic step.
    atomic_create: ClassVar[bool] = True

    #: Slack for comparing the backend's mtime with the local clock.
    mtime_slack_s: ClassVar[float] = 120.0

    @pytest.fixture
    def store(self) -> Iterator[ObjectStore]:
        raise NotImplementedError("subclasses provide an empty store")
        yield  # pragma: no cover - makes this a generator fixture like the overrides

    # -- round trips ----------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4097, 5 * MiB], ids=["empty", "1B", "4KiB+1", "5MiB"])
    def test_round_trip_is_bit_exact(self, store: ObjectStore, size: int) -> None:
        data = payload(size)
        assert store.put("ns/ab/obj", data) is True
        got = store.get("ns/ab/obj")
        assert type(got) is bytes
        assert len(got) == size
        assert got == data

    @pytest.mark.parametrize(
        "wrap",
        [bytes, bytearray, memoryview, lambda b: memoryview(b"pad" + b + b"pad")[3:-3]],
        ids=["bytes", "bytearray", "memoryview", "memoryview-slice"],
    )
    def test_put_accepts_buffers(self, store: ObjectStore, wrap: Callable[[bytes], Any]) -> None:
        data = payload(1000, seed=1)
        assert store.put("buf", wrap(data)) is True
        assert store.get("buf") == data

    def test_keys_with_every_allowed_character(self, store: ObjectStore) -> None:
        key = "Name-space_1.0/ab/0123456789abcdef.kvc"
        assert store.put(key, b"x") is True
        assert store.get(key) == b"x"
        assert [i.key for i in store.list()] == [key]

    # -- create-only --------------------------------------------------------------------------

    def test_second_put_of_same_key(self, store: ObjectStore) -> None:
        data = payload(100, seed=2)
        assert store.put("dup", data) is True
        second = store.put("dup", data)
        assert second is (not self.detects_existing)
        assert store.get("dup") == data

    def test_put_never_changes_an_existing_object(self, store: ObjectStore) -> None:
        if not self.detects_existing:
            pytest.skip("backend cannot detect existing objects; it overwrites")
        original = payload(100, seed=3)
        assert store.put("imm", original) is True
        assert store.put("imm", payload(200, seed=4)) is False
        assert store.get("imm") == original
        info = store.head("imm")
        assert info is not None and info.size == len(original)

    def test_concurrent_puts_of_one_key(self, store: ObjectStore) -> None:
        n = 16
        data = payload(256 * 1024, seed=5)
        barrier = threading.Barrier(n)
        results: list[Any] = [None] * n

        def writer(i: int) -> None:
            barrier.wait()
            try:
                results[i] = store.put("hot/key", data)
            except Exception as exc:  # collected so the assertion shows what went wrong
                results[i] = exc

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(isinstance(r, bool) for r in results), results
        if self.detects_existing and self.atomic_create:
            assert results.count(True) == 1, results
        else:
            assert results.count(True) >= 1, results
        assert store.get("hot/key") == data
        keys = [i.key for i in store.list()]
        assert keys == ["hot/key"], keys

    # -- get / head / delete ------------------------------------------------------------------

    def test_get_missing_raises(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.get("no/such/key")
        assert issubclass(ObjectNotFoundError, StoreError)

    @pytest.mark.parametrize("size", [0, 10, 3 << 20])
    def test_open_read_streams_the_object(self, store: ObjectStore, size: int) -> None:
        data = payload(size, seed=11)
        store.put("stream/obj", data)
        with store.open_read("stream/obj") as reader:
            head = reader.read(7)
            buf = bytearray(max(0, size - 7))
            filled = 0
            while filled < len(buf):
                got = reader.readinto(memoryview(buf)[filled:])
                assert got
                filled += got
            assert reader.read(1) == b""
        assert head + bytes(buf) == data
        with pytest.raises(ObjectNotFoundError):
            store.open_read("no/such/key")

    def test_touch_refreshes_mtime(self, store: ObjectStore) -> None:
        data = payload(1000, seed=12)
        store.put("t/obj", data)
        first = store.head("t/obj")
        assert first is not None
        time.sleep(1.1)  # S3's Last-Modified has one-second resolution
        assert store.touch("t/obj") is True
        second = store.head("t/obj")
        assert second is not None and second.last_modified > first.last_modified
        # gc reads mtimes from the listing first: the refresh must show there too
        (listed,) = [i for i in store.list("t/") if i.key == "t/obj"]
        assert listed.last_modified > first.last_modified
        assert store.get("t/obj") == data
        assert store.touch("t/missing") is False

    def test_head(self, store: ObjectStore) -> None:
        before = time.time()
        store.put("h/obj", payload(1234, seed=6))
        after = time.time()
        info = store.head("h/obj")
        assert info is not None
        assert info.key == "h/obj"
        assert info.size == 1234
        # Backends round mtimes (S3: to the second), and server clocks drift a little.
        assert before - self.mtime_slack_s <= info.last_modified <= after + self.mtime_slack_s
        assert store.exists("h/obj")

    def test_head_missing_is_none(self, store: ObjectStore) -> None:
        assert store.head("h/absent") is None
        assert not store.exists("h/absent")

    def test_delete(self, store: ObjectStore) -> None:
        store.put("d/obj", b"bye")
        store.delete("d/obj")
        with pytest.raises(ObjectNotFoundError):
            store.get("d/obj")
        assert store.head("d/obj") is None
        store.delete("d/obj")  # again: idempotent
        store.delete("d/never-existed")
        assert list(store.list()) == []

    def test_put_after_delete_creates_again(self, store: ObjectStore) -> None:
        assert store.put("again", b"1") is True
        store.delete("again")
        assert store.put("again", b"1") is True
        assert store.get("again") == b"1"

    # -- list ---------------------------------------------------------------------------------

    def test_list_empty(self, store: ObjectStore) -> None:
        assert list(store.list()) == []
        assert list(store.list("ns/")) == []

    def test_list(self, store: ObjectStore) -> None:
        sizes = {"ns/ab/1": 1, "ns/ab/22": 22, "ns/cd/3": 3, "other/4": 4, "top": 5}
        for key, size in sizes.items():
            assert store.put(key, payload(size)) is True

        def listed(prefix: str = "") -> dict[str, int]:
            infos = list(store.list(prefix))
            keys = [i.key for i in infos]
            assert len(keys) == len(set(keys)), keys  # no duplicates
            return {i.key: i.size for i in infos}

        assert listed() == sizes
        assert listed("ns/") == {k: v for k, v in sizes.items() if k.startswith("ns/")}
        assert listed("ns/ab/") == {"ns/ab/1": 1, "ns/ab/22": 22}
        assert listed("ns/ab/2") == {"ns/ab/22": 22}  # a partial last segment filters too
        assert listed("ns") == {k: v for k, v in sizes.items() if k.startswith("ns")}
        assert listed("t") == {"top": 5}
        assert listed("zzz/") == {}
        assert listed("nope") == {}

    def test_list_after_delete(self, store: ObjectStore) -> None:
        store.put_many([(f"l/{i}", b"x") for i in range(5)])
        store.delete("l/2")
        assert sorted(i.key for i in store.list("l/")) == ["l/0", "l/1", "l/3", "l/4"]

    # -- batch ----------------------------------------------------------------------------------

    def test_get_many_keeps_key_order(self, store: ObjectStore) -> None:
        items = {f"m/{i:02d}": payload(100 + i, seed=i) for i in range(20)}
        for key, data in items.items():
            store.put(key, data)
        keys = ["m/05", "m/missing", *sorted(items, reverse=True), "m/05"]
        results = store.get_many(keys)
        assert len(results) == len(keys)
        for key, got in zip(keys, results, strict=True):
            if key == "m/missing":
                assert isinstance(got, ObjectNotFoundError)
            else:
                assert got == items[key]
        assert store.get_many([]) == []
        single = store.get_many(["m/missing"])
        assert len(single) == 1 and isinstance(single[0], ObjectNotFoundError)

    def test_put_many(self, store: ObjectStore) -> None:
        items = [(f"p/{i:03d}", payload(1000 + i, seed=i)) for i in range(64)]
        assert store.put_many(items) == [True] * len(items)
        again = store.put_many(items)
        assert again == [not self.detects_existing] * len(items)
        assert store.get_many([k for k, _ in items]) == [d for _, d in items]
        assert sorted(i.key for i in store.list("p/")) == [k for k, _ in items]

    def test_put_many_reports_bad_keys_in_place(self, store: ObjectStore) -> None:
        results = store.put_many([("ok/1", b"a"), ("../bad", b"b"), ("ok/2", b"c")])
        assert results[0] is True and results[2] is True
        assert isinstance(results[1], StoreError)

    # -- keys -----------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_keys_are_refused(self, store: ObjectStore, key: str) -> None:
        with pytest.raises(StoreError):
            store.put(key, b"evil")
        with pytest.raises(StoreError):
            store.get(key)
        with pytest.raises(StoreError):
            store.head(key)
        with pytest.raises(StoreError):
            store.delete(key)
        results = store.get_many([key, key])
        assert all(isinstance(r, StoreError) for r in results)
        assert list(store.list()) == []

    def test_non_string_key_is_refused(self, store: ObjectStore) -> None:
        with pytest.raises(StoreError):
            store.put(b"bytes-key", b"x")  # type: ignore[arg-type]

    # -- lifecycle ------------------------------------------------------------------------------

    def test_url_and_repr_name_the_store(self, store: ObjectStore) -> None:
        assert store.url
        assert store.url in repr(store)

    def test_context_manager_closes(self, store: ObjectStore) -> None:
        closed: list[bool] = []
        original_close = store.close

        def close() -> None:
            closed.append(True)
            original_close()

        store.close = close  # type: ignore[method-assign]
        with store as entered:
            assert entered is store
            store.put_many([("cm/1", b"1"), ("cm/2", b"2")])  # starts the pool
            pool = store.executor
        assert closed == [True]
        with pytest.raises(RuntimeError):
            pool.submit(lambda: None)  # the pool was shut down
