"""What each fault-injection scenario observed, one JSON line per test.

Lines go to the file named by ``$KVCLOUD_RELIABILITY_LOG`` (appended; nothing is written when
it is unset). docs/RELIABILITY.md is generated from them, so every line says what the fault
was, what must happen, what the run saw and whether the test passed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

LOG_ENV = "KVCLOUD_RELIABILITY_LOG"


@dataclass
class Observation:
    """Filled in by a test while it runs; written by the ``reliability`` fixture after it."""

    scenario: str = ""
    must: str = ""
    observed: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def note(self, **values: Any) -> None:
        self.observed.update(values)


def write(line: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True, default=str) + "\n")


def finish(obs: Observation, request: pytest.FixtureRequest) -> None:
    """Write the observation with the test's outcome (set by pytest_runtest_makereport)."""
    if not obs.scenario:
        return
    report = getattr(request.node, "_kvcloud_call_report", None)
    if report is None:
        outcome = "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed" if report.passed else "failed"
    line: dict[str, Any] = {
        "test": request.node.nodeid,
        "scenario": obs.scenario,
        "must": obs.must,
        "observed": obs.observed,
        "outcome": outcome,
        "seconds": round(time.monotonic() - obs.started, 2),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if report is not None and report.failed:
        # the assertion and its message: the last lines of the traceback
        line["failure"] = "\n".join(str(report.longrepr).splitlines()[-6:])[-1500:]
    if report is not None and report.skipped:
        line["skip_reason"] = str(report.longrepr)[-500:]
    write(line)


# Re-exported by the conftest of each directory whose tests log observations.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each test's call report on the item, for finish() to read its outcome."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.when == "call" or (rep.when == "setup" and rep.skipped):
        item._kvcloud_call_report = rep  # type: ignore[attr-defined]


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Iterator[Observation]:
    obs = Observation()
    yield obs
    finish(obs, request)
