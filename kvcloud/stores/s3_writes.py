"""Write-once PUTs on S3 servers that honour, ignore or refuse ``If-None-Match: *``.

A kvcloud object is content-addressed, so writing it twice is harmless; what ``put`` must
still say truthfully is whether the object already existed, because the caller then
refreshes it (``touch``) so that gc's grace period protects an old orphan that a new entry
is about to name (invariants 1, 2 and 6, docs/ARCHITECTURE.md). AWS S3, MinIO, Ceph RGW
and moto answer 412 to a conditional PUT of an existing key. OpenStack Swift's ``s3api`` answers
``501 NotImplemented``; ``rclone serve s3`` (and s3rver) ignore the header and overwrite.
On those, ``put`` asks with a HEAD first and writes only an absent key: a duplicate push then
costs one small round trip instead of a rewrite, and the answer means the same everywhere.

Which kind of server a store talks to is found once per process and endpoint, on the first
write (a read-only worker never writes a probe): two conditional PUTs of a throwaway key
under the store's prefix, then its DELETE.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable

log = logging.getLogger("kvcloud.stores.s3")

HONOURED = "honoured"
"""The server answers 412 to a conditional PUT of an existing key."""
IGNORED = "ignored"
"""The server accepts ``If-None-Match: *`` and overwrites anyway."""
REFUSED = "refused"
"""The server rejects the header (501 NotImplemented)."""
OFF = "off"
"""The store was told not to send the header (``conditional_put=off``)."""

MODES = ("auto", "on", "off")
"""What ``S3Config.conditional_put`` takes: probe the server, trust it, or never send."""

PROBE_DIR = "_kvcloud"
"""Where the probe key lives under the store's prefix; ``gc`` and ``verify`` only look at
object-shaped keys, so a probe left behind by a crash is never mistaken for a segment."""

# (endpoint, bucket) → what the server did, for every store of this process
_found: dict[tuple[str | None, str], str] = {}
_found_lock = threading.Lock()


def parse_mode(raw: object) -> str:
    """``auto``, ``on`` or ``off``; booleans (and their spellings) mean on and off."""
    if isinstance(raw, bool):
        return "on" if raw else "off"
    value = str(raw).strip().lower()
    if value in MODES:
        return value
    if value in ("1", "true", "yes"):
        return "on"
    if value in ("0", "false", "no", ""):
        return "off"
    raise ValueError(f"conditional_put must be auto, on or off, not {raw!r}")


def refused(code: str, status: int) -> bool:
    """The server does not implement the conditional header (Swift s3api: 501)."""
    return status == 501 or code == "NotImplemented"


def probe(put_conditional: Callable[[str], bool | None], delete: Callable[[str], None]) -> str:
    """What the server does with ``If-None-Match: *``: HONOURED, IGNORED or REFUSED.

    ``put_conditional(key)`` (a store key, under the store's prefix) answers True
    (written), False (412: it exists) or None (the header was refused); its store errors
    propagate, and nothing is remembered then.
    """
    key = f"{PROBE_DIR}/conditional-put-{secrets.token_hex(8)}"
    try:
        first = put_conditional(key)
        if first is None:
            return REFUSED
        if first is False:  # another writer cannot own a random key: the server lies
            return IGNORED
        return HONOURED if put_conditional(key) is False else IGNORED
    finally:
        try:
            delete(key)
        except Exception as exc:  # best effort: a leftover probe is a few bytes, never read
            log.debug("could not delete the conditional-write probe %s: %s", key, exc)


def remembered(endpoint: str | None, bucket: str) -> str | None:
    with _found_lock:
        return _found.get((endpoint, bucket))


def remember(endpoint: str | None, bucket: str, where: str, mode: str) -> None:
    with _found_lock:
        before = _found.get((endpoint, bucket))
        _found[(endpoint, bucket)] = mode
    if mode != before and mode in (IGNORED, REFUSED):
        log.warning(
            "the S3 server at %s %s If-None-Match on PUT: kvcloud checks with a HEAD before "
            "each write instead (one extra round trip per object, nothing else changes)",
            where,
            "ignores" if mode == IGNORED else "refuses",
        )


def forget() -> None:
    """Drop what was found about every server (tests that change a server's behaviour)."""
    with _found_lock:
        _found.clear()
