"""What ``verify`` and ``gc`` both read: the store's kvcloud-shaped objects, the index's
session records, and the object-key shape that decides what either may ever touch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TypeVar

from ..errors import CorruptObjectError
from ..indexes.base import Index
from ..sessions import SessionRecord, unpack_record
from ..stores.base import ObjectInfo, ObjectStore

#: ``progress(phase, advance, total)``: ``advance`` more items of ``phase`` are done;
#: ``total`` is the phase's size when known (else None). Called from the caller's thread.
ProgressFn = Callable[[str, int, int | None], None]

# Object keys as the client writes them: <ns id (16 bytes hex)>/<d[:2]>/<d>, d = BLAKE3-256
# hex + ".b3l" (format v3, the header's digest) or ".b3" (v2, the whole object's), or bare
# SHA-256 hex (format v1, still read).
# gc deletes nothing else: a bucket prefix shared with other data, or a future key scheme,
# must never be collected by a gc that does not understand it.
_KEY_RE = re.compile(r"^(?P<ns>[0-9a-f]{32})/(?P<d2>[0-9a-f]{2})/(?P<d>[0-9a-f]{64}(\.b3l?)?)$")

BATCH = 256  # keys per parallel round of HEAD/GET/DELETE

T = TypeVar("T")


def is_object_key(key: str) -> bool:
    """True for keys shaped like the client's ``<ns>/<d[:2]>/<d>``."""
    m = _KEY_RE.match(key)
    return m is not None and m.group("d").startswith(m.group("d2"))


def key_ns(key: str) -> str | None:
    m = _KEY_RE.match(key)
    return m.group("ns") if m else None


def batched(items: Iterable[T], n: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def list_objects(
    store: ObjectStore, progress: ProgressFn | None, phase: str = "listing objects"
) -> tuple[dict[str, ObjectInfo], int, int]:
    """kvcloud-shaped objects by key, plus the count and bytes of anything else."""
    objects: dict[str, ObjectInfo] = {}
    foreign = foreign_bytes = 0
    for n, info in enumerate(store.list(), 1):
        if is_object_key(info.key):
            objects[info.key] = info
        else:
            foreign += 1
            foreign_bytes += info.size
        if progress and n % 1000 == 0:
            progress(phase, 1000, None)
    if progress:
        progress(phase, (len(objects) + foreign) % 1000, None)
    return objects, foreign, foreign_bytes


def read_sessions(
    index: Index,
) -> tuple[list[tuple[str, str, SessionRecord]], list[tuple[str, str, str]]]:
    """Parsed records, and (scope, session id, error) for records that do not parse."""
    good: list[tuple[str, str, SessionRecord]] = []
    bad: list[tuple[str, str, str]] = []
    for scope, sid, raw in index.iter_sessions():
        try:
            good.append((scope, sid, unpack_record(sid, raw)))
        except CorruptObjectError as exc:
            bad.append((scope, sid, str(exc)))
    return good, bad
