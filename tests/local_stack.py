"""What the tests of infra/local/start.sh read back from a running stack: whether a process it
started is still alive, and the exports it writes for a user to source."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not any(line.startswith("State:") and "Z" in line for line in status.splitlines())


def stack_exports(state: Path) -> dict[str, str]:
    """The ``export NAME='value'`` lines of ``$STATE/env`` (KVCLOUD_STORE, AWS keys, …)."""
    exports = {}
    for line in (state / "env").read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            exports[name] = value.strip("'")
    return exports
