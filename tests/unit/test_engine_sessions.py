"""Sessions shared by workers behind a load balancer, engine by engine (tiny preset, a real
file store and SQLite index): write-through per turn, the staleness check before a turn,
records that name only stored objects, records from before revisions, and the index being
down at either point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvcloud.errors import IndexBackendError
from kvcloud.sessions import REVISION_KEY, unpack_record
from workers.config import WorkerOptions
from workers.engine import CompletionRequest, Engine

C = 16
T = "default"


def opts(tmp: Path, **kw: Any) -> WorkerOptions:
    base: dict[str, Any] = dict(
        model="tiny",
        cache_pages=32,
        chunk_tokens=C,
        store=f"file://{tmp / 'objects'}",
        index=f"sqlite://{tmp / 'index.db'}",
    )
    base.update(kw)
    return WorkerOptions(**base)


def req(tokens: list[int], sid: str, n: int = 6) -> CompletionRequest:
    return CompletionRequest(prompt_tokens=tokens, max_tokens=n, stop_at_eos=False, session_id=sid)


def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, n)]


TURNS = [prompt(37, 1), prompt(21, 2), prompt(29, 3), prompt(18, 4)]


def checks(e: Engine, result: str) -> float:
    return e.metrics.session_checks.labels(result)._value.get()  # type: ignore[no-any-return]


def writes(e: Engine, result: str) -> float:
    return e.metrics.session_writes.labels(result)._value.get()  # type: ignore[no-any-return]


@pytest.fixture
def reference() -> list[list[int]]:
    """The conversation on one engine without a store."""
    e = Engine(WorkerOptions(model="tiny", cache_pages=32, chunk_tokens=C, store=None))
    try:
        sid = e.create_session(T)
        return [e.complete(req(t, sid)).tokens for t in TURNS]
    finally:
        e.close()


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    a, b = Engine(opts(tmp_path, worker_id="a")), Engine(opts(tmp_path, worker_id="b"))
    yield a, b
    a.close()
    b.close()


def test_turns_alternating_engines_continue_each_others_turns(
    pair: tuple[Engine, Engine], reference: list[list[int]]
) -> None:
    """A, B, A, B without a flush: every turn sees every earlier one. Turn 3 finds A's copy
    (as of turn 1) stale, drops it and restores B's record."""
    a, b = pair
    sid = a.create_session(T)
    got, lengths = [], []
    for i, t in enumerate(TURNS):
        r = (a, b)[i % 2].complete(req(t, sid))
        got.append(r.tokens)
        lengths.append(r.session_tokens)
    assert got == reference
    assert lengths == list(np.cumsum([len(t) + 6 for t in TURNS]))
    assert checks(a, "stale") == 1 and checks(b, "stale") == 1  # turn 3 on A, turn 4 on B
    assert writes(a, "ok") == 2 and writes(b, "ok") == 2
    # the last writer's copy is current: another turn on B reads, compares, keeps it
    r = b.complete(req(prompt(5, 9), sid))
    assert checks(b, "current") == 1
    # A's copy (turn 3) is not what it reports: B's turns are
    info = a.session_info(sid, T)
    assert info.tokens == r.session_tokens and not info.resident


def test_stale_resident_copy_is_used_without_the_check(tmp_path: Path) -> None:
    """What the check prevents: with write-through off (flush-only, one worker per session),
    A answers turn 3 from its own turn-1 history even though B flushed turn 2."""
    a = Engine(opts(tmp_path, session_write_through=False))
    b = Engine(opts(tmp_path, session_write_through=False))
    try:
        sid = a.create_session(T)
        a.complete(req(TURNS[0], sid))
        a.flush_session(sid, T)
        r2 = b.complete(req(TURNS[1], sid))
        b.flush_session(sid, T)
        r3 = a.complete(req(TURNS[2], sid))
        # turn 2 is missing: a wrong answer, and no error
        assert r3.session_tokens == r2.session_tokens - len(TURNS[1]) - 6 + len(TURNS[2]) + 6
        assert checks(a, "current") == checks(a, "stale") == 0  # no index call per turn
    finally:
        a.close()
        b.close()


def test_record_is_written_each_turn_and_names_only_stored_objects(tmp_path: Path) -> None:
    a = Engine(opts(tmp_path))
    try:
        sid = a.create_session(T)
        long = prompt(5 * C + 3, 7)
        r = a.complete(req(long, sid))
        rec = a.kv.load_session(a.ns, sid, T)  # type: ignore[union-attr]
        assert rec.n_tokens == r.session_tokens and rec.revision is not None
        assert rec.tail_key is None and rec.kv_tokens == len(rec.chunk_keys) * C
        for key in rec.object_keys:
            assert a.kv.store.head(key) is not None  # type: ignore[union-attr]
        # the full pages went to the uploader; once stored, the next record names them
        assert a.uploader is not None and a.uploader.drain(10)
        a.complete(req(prompt(3, 8), sid))
        rec2 = a.kv.load_session(a.ns, sid, T)  # type: ignore[union-attr]
        assert rec2.revision != rec.revision
        assert len(rec2.chunk_keys) >= (len(long) + 1) // C  # BOS + prompt, full chunks
        for key in rec2.object_keys:
            assert a.kv.store.head(key) is not None  # type: ignore[union-attr]
    finally:
        a.close()


def test_restore_recomputes_what_the_record_does_not_name(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    """Write-back, a turn, no upload yet: the record names no KV at all; another engine
    restores the history and recomputes every token, with the same answer."""
    a = Engine(opts(tmp_path, write_policy="off"))  # nothing is ever uploaded
    b = Engine(opts(tmp_path))
    try:
        sid = a.create_session(T)
        a.complete(req(TURNS[0], sid))
        rec = a.kv.load_session(a.ns, sid, T)  # type: ignore[union-attr]
        assert rec.kv_tokens == 0 and rec.chunk_keys == () and rec.tail_key is None
        r = b.complete(req(TURNS[1], sid))
        assert r.tokens == reference[1]
        assert r.tokens_remote == 0 and r.tokens_computed == r.prompt_tokens
    finally:
        a.close()
        b.close()


def test_records_without_a_revision_load_and_are_checked(tmp_path: Path) -> None:
    """Records written before revisions existed (no ``rev`` in meta) still restore; a worker
    tells one such record from the next by its timestamp (compared for equality only)."""
    e = Engine(opts(tmp_path))
    try:
        kv = e.kv
        assert kv is not None
        sid = "sess_old_format"
        history = prompt(20, 5)
        kv.write_session(e.ns, sid, history, 0, [], None, T)  # no meta: the old writer
        raw = kv.index.get_session(kv.session_scope(T), sid)
        assert raw is not None and REVISION_KEY not in msgpack.unpackb(raw)["meta"]
        assert unpack_record(sid, raw).revision is None
        r = e.complete(req(prompt(4, 6), sid))
        assert r.session_tokens == 20 + 4 + 6
        # an older worker writes the session again (another history, no revision)
        kv.write_session(e.ns, sid, prompt(30, 7), 0, [], None, T)
        r = e.complete(req(prompt(4, 6), sid))
        assert checks(e, "stale") == 1 and r.session_tokens == 30 + 4 + 6
    finally:
        e.close()


def test_index_down_the_turn_is_answered_from_the_resident_copy(
    pair: tuple[Engine, Engine], reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Check and write-through fail: logged, counted, answered from this worker's copy; the
    next turn here writes the record again and another worker continues from it."""
    a, b = pair
    sid = a.create_session(T)
    a.complete(req(TURNS[0], sid))
    kv = a.kv
    assert kv is not None

    def down(*args: Any, **kwargs: Any) -> Any:
        raise IndexBackendError("index unreachable (test)")

    with monkeypatch.context() as m:
        m.setattr(kv, "load_session", down)
        m.setattr(kv, "write_session", down)
        r2 = a.complete(req(TURNS[1], sid))
    assert r2.tokens == reference[1]
    assert checks(a, "unavailable") == 1 and writes(a, "failed") == 1
    r3 = a.complete(req(TURNS[2], sid))  # index back: the check finds A's own last record
    assert r3.tokens == reference[2] and checks(a, "current") == 2  # turns 1 and 3
    assert b.complete(req(TURNS[3], sid)).tokens == reference[3]


def test_letting_go_of_a_stale_copy_does_not_overwrite_a_newer_record(
    pair: tuple[Engine, Engine],
) -> None:
    """A flush of A's older copy (explicit, on shutdown, or when trimmed) must not replace
    B's turn: A drops its copy and reports the stored record."""
    a, b = pair
    sid = a.create_session(T)
    a.complete(req(TURNS[0], sid))
    r2 = b.complete(req(TURNS[1], sid))
    fr = a.flush_session(sid, T)
    assert fr.tokens == r2.session_tokens and fr.chunks_pushed == 0
    assert (T, sid) not in a.sessions
    # and on shutdown: B's turn 3 after A took the session back for nothing
    a.complete(req(TURNS[2], sid))
    r4 = b.complete(req(TURNS[3], sid))
    a.flush_all(timeout=5)
    rec = a.kv.load_session(a.ns, sid, T)  # type: ignore[union-attr]
    assert rec.n_tokens == r4.session_tokens


def test_a_turn_whose_reader_leaves_is_written_as_it_ended(tmp_path: Path) -> None:
    """A streaming client that disconnects ends the turn at the next token; the record
    written for it holds exactly that turn (the prompt and the tokens generated)."""
    a = Engine(opts(tmp_path))
    try:
        sid = a.create_session(T)
        got: list[int] = []

        def reader(tok: int) -> bool:
            got.append(tok)
            return len(got) < 3  # gone after the third token

        r = a.complete(
            CompletionRequest(
                TURNS[0], max_tokens=50, session_id=sid, on_token=reader, stop_at_eos=False
            )
        )
        assert r.tokens == got and len(got) == 3
        rec = a.kv.load_session(a.ns, sid, T)  # type: ignore[union-attr]
        assert rec.tokens.tolist() == [*TURNS[0], *got]
    finally:
        a.close()
