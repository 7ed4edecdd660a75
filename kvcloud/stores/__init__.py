"""Object stores, chosen by URL (see open_store)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote

from ..errors import ConfigError
from ..urls import env_bool, redact_url, split_url
from .base import ObjectInfo, ObjectStore
from .file import FileStore

# s3.py imports boto3 only when an S3Store is built, so this import is cheap and works
# without the [s3] extra installed.
from .s3 import S3Store
from .s3_config import S3Config

KNOWN_SCHEMES = ("file://", "s3://")
_FILE_OPTIONS = ("fsync", "threads")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def open_store(
    url: str,
    *,
    max_workers: int = 16,
    connect_timeout: float = 2.0,
    read_timeout: float = 10.0,
    fsync: bool = False,
    max_attempts: int | None = None,
) -> ObjectStore:
    """Open the store a URL names (URLs choose the backends).

    ``file:///abs/dir`` (or ``file://rel/dir``, relative to the working directory) and
    ``s3://bucket/prefix?endpoint_url=…&region=…``. Options in the URL's query string win
    over the keyword arguments, so one URL string fully configures a worker.
    """
    if "://" not in url:
        raise ConfigError(
            f"store URL {redact_url(url)!r} has no scheme; for a directory write "
            f"file:///absolute/path or file://relative/path (known: {', '.join(KNOWN_SCHEMES)})"
        )
    scheme, netloc, path, query = split_url(url)
    if scheme == "file":
        unknown = sorted(set(query) - set(_FILE_OPTIONS))
        if unknown:
            raise ConfigError(
                f"{redact_url(url)!r}: unknown option(s) {', '.join(unknown)}; "
                f"known: {', '.join(_FILE_OPTIONS)}"
            )
        root = unquote(netloc + path)
        if not root:
            raise ConfigError(f"{redact_url(url)!r} names no directory (file:///path)")
        if "fsync" in query:
            try:
                fsync = env_bool(query["fsync"])
            except ConfigError as exc:
                raise ConfigError(f"{redact_url(url)!r}: fsync: {exc}") from None
        # Reads and writes that hit the page cache are CPU work (copies and the digest):
        # threads beyond the CPUs only contend for them (measured: 16 chunks pulled in
        # 11.0 ms with 2 threads on 2 CPUs, 13.3 ms with 16). ?threads= for a slow or
        # network file system, where more requests in flight hide latency.
        threads = min(max_workers, max(2, _usable_cpus()))
        if "threads" in query:
            try:
                threads = int(query["threads"])
            except ValueError:
                threads = 0
            if threads < 1:
                raise ConfigError(f"{redact_url(url)!r}: threads must be a positive integer")
        return FileStore(root, fsync=fsync, max_workers=threads)
    if scheme == "s3":
        defaults: dict[str, Any] = {
            "max_connections": max_workers,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
        }
        if max_attempts is not None:
            # callers with a latency budget (a worker's request path) cap retries: each
            # attempt may take a full read timeout
            defaults["max_attempts"] = max_attempts
        # from_url's keyword overrides beat the query; pass only what the URL leaves unset.
        overrides = {k: v for k, v in defaults.items() if k not in query}
        return S3Store(S3Config.from_url(url, **overrides))
    raise ConfigError(
        f"unknown store scheme {scheme + '://'!r} in {redact_url(url)!r}; "
        f"known: {', '.join(KNOWN_SCHEMES)}"
    )


__all__ = ["FileStore", "ObjectInfo", "ObjectStore", "S3Config", "S3Store", "open_store"]
