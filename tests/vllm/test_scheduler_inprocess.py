"""vLLM's own v1 Scheduler, in-process, with the kvcloud connector's scheduler side attached:
every chunk the connector names for saving names the request's blocks at that step, also
after vLLM preempts the request and resumes it (issue 40 defect 1).

With the V2 model runner vLLM sends a resumed request as a new one (``resumed_req_ids``
stays empty); with the V1 one, as a cached request in ``resumed_req_ids``. Both are run.
No model and no server: scripts/checks/vllm_scheduler_inprocess.py fabricates each step's runner
output, so vLLM's import is most of the time (~20 s of CPU): one process per set-up runs both
model runners' semantics, and the first one also runs the asynchronous-load scenarios.

Issue 40 defect 3, asynchronous loads (``load_mode=async``: the request waits in vLLM's
WAITING_FOR_REMOTE_KVS state) of a prompt stored beforehand, that end otherwise than loaded:

- the worker reports the load failed from its first chunk (every block invalid), with or
  without naming that chunk's object bad: vLLM frees the blocks and asks the connector
  again; it must not offer the same load again (before the fix it did, after every failure
  the worker blamed on no object: the request never ran), and the chunks the request then
  recomputes are saved (before the fix, none was when the object was named bad);
- the request is aborted while it waits: vLLM keeps its blocks until the worker reports the
  load over, then frees them; the connector forgets the request, and a later request for the
  same prompt loads it again.

Issue 40 defect 4: a burst of 48 new requests while one decodes, against a real Redis
directly and through a proxy that holds every request 300 ms: vLLM's scheduler asks the
connector about each waiting request it has room for in one pass, and the connector must
wait ``lookup_wait_ms`` once per pass, not once per request (before the fix: 16 × 20 ms a
pass while the index was slow, every running decode waiting with it).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.fleet.fault_proxy import FaultProxy
from scripts.fleet.vllm_fleet import ROOT, VLLM_PYTHON
from tests.servers import start_redis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = ROOT / "scripts" / "checks" / "vllm_scheduler_inprocess.py"

# Two set-ups whose preemptions vLLM's scheduling makes the same on every run (they depend
# on sizes only, never on the random token values):
SCENARIOS = {
    # 4 requests of 300 + 260 tokens in 48 blocks: 3 preemptions while decoding; the
    # chunks saved after each resume are answer chunks (save_decode). The same process runs
    # the asynchronous-load scenarios (one request of 300 + 40 tokens each, its 4 chunks
    # stored beforehand): one vLLM import for both
    "decode": ["--failed-first-chunk", "--abort-while-loading"],
    # 6 requests of 216 + 62 tokens in 43 blocks, 128-token steps: one request is preempted
    # half-way through its prompt, so prompt chunks too are saved after its resume; before
    # the fix, blocks of other running requests were named, and one chunk never was
    "mid-prompt": [
        "--requests", "6", "--prompt-tokens", "216", "--max-tokens", "62",
        "--blocks", "43", "--batch-tokens", "128", "--seed", "33",
    ],
}  # fmt: skip


# the set-up whose process also runs the asynchronous-load scenarios
LOADS = "decode"


@pytest.fixture(scope="module")
def burst_indexes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A real Redis, and the same behind a proxy holding each request 300 ms."""
    redis = start_redis(tmp_path_factory.mktemp("burst-redis"))
    proxy = FaultProxy(redis.port, delay=0.3)
    proxy.set_mode("slow")
    try:
        slow = redis.url.replace(f":{redis.port}/", f":{proxy.port}/")
        assert slow != redis.url
        yield ["--burst", f"healthy={redis.url}", f"slow={slow}"]
    finally:
        proxy.close()
        redis.stop()


@pytest.fixture(scope="module")
def processes(burst_indexes: list[str]) -> Callable[[str], list[dict[str, Any]]]:
    """Each set-up's JSON lines, its process run once whichever test asks first."""
    done: dict[str, list[dict[str, Any]]] = {}

    def lines(scenario: str) -> list[dict[str, Any]]:
        if scenario not in done:
            # this checkout's kvcloud, whatever the vLLM venv has installed
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            extra = burst_indexes if scenario == LOADS else []
            proc = subprocess.run(
                [str(VLLM_PYTHON), str(SCRIPT), "--v2", "--v1", *SCENARIOS[scenario], *extra],
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
                timeout=280,
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            out = proc.stdout.splitlines()
            done[scenario] = [json.loads(line) for line in out if line.startswith("{")]
        return done[scenario]

    return lines


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def figures(
    request: pytest.FixtureRequest, processes: Callable[[str], list[dict[str, Any]]]
) -> tuple[str, dict[bool, dict[str, Any]]]:
    """A set-up's figures under both model runners, by ``v2`` (one process for both)."""
    scenario: str = request.param
    return scenario, {r["v2"]: r for r in processes(scenario) if "v2" in r}


@pytest.fixture(scope="module")
def loads(processes: Callable[[str], list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The asynchronous-load scenarios' figures, by name."""
    return {r["scenario"]: r for r in processes(LOADS) if "scenario" in r}


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_saves_name_the_requests_blocks_across_preemptions(
    figures: tuple[str, dict[bool, dict[str, Any]]], v2: bool
) -> None:
    scenario, runs = figures
    got = runs[v2]
    print(json.dumps({k: v for k, v in got.items() if k != "details"}))
    assert Path(got["kvcloud"]).resolve().is_relative_to(ROOT.resolve()), got["kvcloud"]
    assert got["v2"] is v2
    assert got["finished"] == got["requests"] and got["preemptions"] >= 1, got
    # the resumed requests came the way this mode sends them, so the branch under test ran
    resumed_as = "resumed_as_new" if v2 else "resumed_as_cached"
    assert got[resumed_as] == got["preemptions"], got
    assert got["save_chunks"] > 0 and got["save_chunks_after_resume"] > 0, got
    if scenario == "mid-prompt":
        assert got["preempted_mid_prompt"] >= 1, got
    # each misnamed chunk: the step, the request, and who holds the blocks it named
    assert got["wrong"] == 0, json.dumps(got["details"], indent=1)
    # every full chunk named once: none lost, none uploaded twice
    assert got["prompt_chunks_never_named"] == [], got
    assert got["answer_chunks_never_named"] == [], got
    assert got["chunks_named_more_than_once"] == {}, got


def _shown(got: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps({k: v for k, v in got.items() if k != "details"}))
    assert Path(got["kvcloud"]).resolve().is_relative_to(ROOT.resolve()), got["kvcloud"]
    # nothing reached vLLM, and the connector caught nothing either
    assert got["exception"] is None, got["exception"]
    assert got["connector_errors"] == 0 and got["caught"] == [], got
    # every chunk named for saving named the request's blocks at that step
    assert got["wrong"] == 0, json.dumps(got["details"], indent=1)
    # the prompt's every full chunk was in the store before the request came
    assert got["stored_chunks"] == got["prompt_chunks"] > 0, got
    return got


@pytest.mark.parametrize("bad_object", [False, True], ids=["report", "bad-object"])
def test_a_load_that_failed_from_its_first_chunk_is_not_offered_again(
    loads: dict[str, dict[str, Any]], bad_object: bool
) -> None:
    got = _shown(loads["failed-first-chunk" + ("-bad-object" if bad_object else "")])
    # the load was offered, ran asynchronously and failed from its first chunk; vLLM freed
    # the blocks and asked the connector again
    assert got["failures_reported"] == 1 and got["asks"] >= 2, got
    assert got["statuses"][0] == "WAITING_FOR_REMOTE_KVS", got
    # offered once. Before the fix, with only vLLM's report (a restore that waited too
    # long on the worker's threads: no object blamed), again after every failure: the
    # request never ran (8 offers in 15 steps, then the run stopped)
    assert got["offers"] == 1 and got["load_specs"] == 1 and not got["looped"], got
    assert got["loads_failed_recomputed"] == 1, got
    # vLLM recomputed it, and every full prompt chunk was named for saving once (before the
    # fix, with the object named bad, none was: the plan still counted them stored)
    assert got["finished"] and "RUNNING" in got["statuses"], got
    assert got["prompt_chunks_named"] == [1] * got["prompt_chunks"], got
    assert got["answer_chunks_named"] == [1] * len(got["answer_chunks_named"]), got
    assert got["connector_state"] == [], got


def test_a_request_aborted_while_loading_is_forgotten_and_its_prompt_loads_again(
    loads: dict[str, dict[str, Any]],
) -> None:
    got = _shown(loads["abort-while-loading"])
    assert got["waiting_for_remote_kvs"] and got["offers"] == got["load_specs"] == 1, got
    assert got["status_after_abort"] == "FINISHED_ABORTED", got
    # vLLM keeps the blocks (the worker may still write into them) until the worker reports
    # the load over, then frees every one of them
    assert got["blocks_kept_until_report"], got
    assert got["reported"] and got["freed_after_report"], got
    assert got["blocks_freed"] == got["load_blocks"] > 0, got
    # the connector forgot the request when vLLM finished it, and holds nothing later
    assert got["connector_state_after_abort"] == [], got
    assert got["connector_state_after_report"] == got["connector_state_at_end"] == [], got
    # a later request for the same prompt is offered the load again, loads it, completes
    assert got["again_offers"] == got["again_load_specs"] == 1 and got["again_finished"], got
    # (its prompt chunks came from the store: none is saved again)
    assert got["again_prompt_chunks_named"] == [0] * got["prompt_chunks"], got


def test_a_burst_against_a_slow_index_costs_each_step_one_lookup_wait(
    loads: dict[str, dict[str, Any]],
) -> None:
    healthy, slow = loads["burst-healthy"], loads["burst-slow"]
    for got in (healthy, slow):
        print(json.dumps(got))
        assert Path(got["kvcloud"]).resolve().is_relative_to(ROOT.resolve()), got["kvcloud"]
        assert got["caught"] == [] and got["lookups"] == got["requests"] + 1, got
        # the decoding request went on through the burst: a token every step
        assert got["stream_tokens_meanwhile"] >= got["steps"], got
    # the slow index made vLLM ask again and again while lookups were out (the path under
    # test ran), and no lookup was given up
    assert slow["lookup_deferrals"] > 0 and slow["lookup_timeouts"] == 0, slow
    # each step waited for lookups at most about once: lookup_wait_ms (20), with room for a
    # busy machine's late wake-ups; before the fix, every request vLLM had room for waited
    # its own 20 ms in the same pass (16 a pass: 320 ms and more)
    assert slow["max_connector_ms_per_step"] < 5 * slow["lookup_wait_ms"], slow
    # (the gaps, measured: docs/VLLM.md; not asserted here, this machine's load moves them)
    print(f"largest gap {slow['max_gap_ms']:.0f} ms slow, {healthy['max_gap_ms']:.0f} healthy")
