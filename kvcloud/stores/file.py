"""``file://`` object store: one file per object under a root directory.

The embedded default (DESIGN §6). Several worker processes on one machine may share a root,
so writes must be atomic and create-only without any lock: each object is written to a
private temp file in its final directory and then hard-linked into place. ``link`` fails with
EEXIST if another process got there first, which is exactly the create-only semantics that
``ObjectStore.put`` promises, and readers never see a partially written object.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import AbstractContextManager, suppress
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ObjectNotFoundError, StoreError
from .base import Buffer, BufferParts, ObjectInfo, ObjectStore, validate_key

TMP_PREFIX = ".tmp-"

# link() is unsupported on some filesystems (FAT, some FUSE and SMB mounts); there we fall
# back to rename(), which is still atomic for readers but cannot detect an existing object.
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


# writev takes at most IOV_MAX buffers per call (1024 on Linux, the POSIX minimum is 16)
_IOV_MAX = 16
with suppress(AttributeError, ValueError, OSError):
    _IOV_MAX = max(_IOV_MAX, min(os.sysconf("SC_IOV_MAX"), 1024))


class FileStore(ObjectStore):
    """Objects as files: key ``ns/ab/abcd`` lives at ``root/ns/ab/abcd``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        max_workers: int = 16,
        create: bool = True,
    ) -> None:
        """``create=False`` (readers: stats, verify, gc, doctor): the root must exist, so a
        mistyped path is an error instead of a new, empty store."""
        super().__init__(max_workers=max_workers)
        # abspath rather than resolve(): a symlinked root should stay as configured in logs.
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.fsync = bool(fsync)
        if not create:
            require_store_root(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store root {self.root}: {exc}") from exc
        if not self.root.is_dir():
            raise StoreError(f"store root {self.root} is not a directory")
        self.url = f"file://{self.root}"

    # -- helpers ------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        validate_key(key)
        # Such a name would be hidden from list() and could collide with a writer's temp file.
        if key.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
            raise StoreError(f"invalid object key {key[:80]!r}: {TMP_PREFIX}* is reserved")
        return self.root / key

    def _fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _make_parents(self, directory: Path) -> None:
        # Find which ancestors are new: their own parents need an fsync for the new entries
        # to survive a crash, otherwise a durable object could sit in a vanished directory.
        missing: list[Path] = []
        d = directory
        while d != self.root and not d.is_dir():
            missing.append(d)
            d = d.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"put: cannot create directory {directory}: {exc}") from exc
        if self.fsync:
            for new in reversed(missing):
                self._fsync_dir(new.parent)

    def _create_tmp(self, directory: Path) -> tuple[Path, int]:
        """A new private temp file in ``directory`` (created with its parents if needed)."""
        tmp = directory / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        # O_EXCL so two writers can never share a temp file; 0o666 so the umask, not this
        # code, decides who else may read the objects.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except FileNotFoundError:
            # Only the first object of a prefix meets a missing directory: trying the open
            # first saves every other put a directory check.
            self._make_parents(directory)
        except OSError as exc:
            raise StoreError(f"put: cannot create a file in {directory}: {exc}") from exc
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except OSError as exc:
            raise StoreError(f"put: cannot create a file in {directory}: {exc}") from exc

    # -- ObjectStore ----------------------------------------------------------------------------

    def put(self, key: str, data: Buffer | BufferParts) -> bool:
        path = self._path(key)
        # Cheap check first: a duplicate push (the common case for shared prefixes) then
        # costs one stat instead of writing the whole object again.
        if os.path.isfile(path):
            return False
        parts = list(data) if isinstance(data, tuple | list) else [data]
        tmp, fd = self._create_tmp(path.parent)
        try:
            try:
                try:
                    _write_all(fd, parts)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                created = self._publish(tmp, path)
                if created and self.fsync:
                    self._fsync_dir(path.parent)
                return created
            except OSError as exc:
                raise StoreError(f"put {key!r} in {self.url} failed: {exc}") from exc
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # already renamed into place by the fallback
            except OSError:
                pass  # a leftover temp file is harmless: list() skips it

    def _publish(self, tmp: Path, path: Path) -> bool:
        try:
            os.link(tmp, path)
        except FileExistsError:
            if path.is_dir():
                raise StoreError(f"put: {path} is a directory, not an object") from None
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINK_ERRNOS:
                raise
            os.replace(tmp, path)
        return True

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{key!r} not found in {self.url}") from None
        except OSError as exc:
            raise StoreError(f"get {key!r} from {self.url} failed: {exc}") from exc

    def touch(self, key: str) -> bool:
        path = self._path(key)
        try:
            os.utime(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise StoreError(f"touch {key!r} in {self.url} failed: {exc}") from exc
        return True

    def open_read(self, key: str) -> AbstractContextManager[Any]:
        path = self._path(key)
        try:
            # unbuffered: the payload is read straight into the caller's buffer
            return open(path, "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{key!r} not found in {self.url}") from None
        except OSError as exc:
            raise StoreError(f"get {key!r} from {self.url} failed: {exc}") from exc

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"head {key!r} in {self.url} failed: {exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(key=key, size=st.st_size, last_modified=st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            pass
        except OSError as exc:
            raise StoreError(f"delete {key!r} from {self.url} failed: {exc}") from exc
        # Empty directories are left in place: removing them would race with a concurrent
        # put that has just created the directory and is about to write into it.

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Only walk the directory the prefix pins down; the last, partial segment is a
        # string filter. Validating the directory part keeps the walk inside the root.
        dir_part, _, _ = prefix.rpartition("/")
        if dir_part:
            validate_key(dir_part)
        start = self.root / dir_part if dir_part else self.root
        return self._walk(start, prefix)

    def _walk(self, start: Path, prefix: str) -> Iterator[ObjectInfo]:
        def on_error(exc: OSError) -> None:
            # A missing start directory just means nothing was stored under the prefix.
            if not isinstance(exc, FileNotFoundError | NotADirectoryError):
                raise StoreError(f"list {prefix!r} in {self.url} failed: {exc}") from exc

        root = str(self.root)
        for dirpath, dirnames, filenames in os.walk(start, onerror=on_error):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in sorted(filenames):
                if name.startswith(TMP_PREFIX):
                    continue
                key = rel_dir + name
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while we walked
                except OSError as exc:
                    raise StoreError(f"list {prefix!r} in {self.url} failed: {exc}") from exc
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(key=key, size=st.st_size, last_modified=st.st_mtime)


def require_store_root(root: str | os.PathLike[str]) -> Path:
    """The root of an existing ``file://`` store; ConfigError naming it when it is missing
    (nothing is created)."""
    path = Path(os.path.abspath(os.fspath(root)))
    if not path.exists():
        raise ConfigError(
            f"no store at file://{path}: the directory does not exist "
            "(check the store URL, KVCLOUD_STORE or --store)"
        )
    if not path.is_dir():
        raise ConfigError(f"no store at file://{path}: it is not a directory")
    return path


def _write_all(fd: int, parts: list[Buffer]) -> None:
    """Write the buffers in order with as few system calls as the kernel allows: one
    writev for an object, with no joined copy of it in user space."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        # a short write (large objects, signals): drop what went out and go on
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if written:
            views[0] = views[0][written:]


__all__ = ["FileStore", "require_store_root"]
