"""What must never share KV, and settings that must stop vLLM at start with one clear line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fleet.vllm_fleet import VLLMServer, cached_tokens, kvcloud_transfer_config
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import wait_stored

# vLLM servers take ~40 s each to start, more when several start together on 2 cores
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("namespaces"), "vllm-ns-secret")


# each setting that must stop vLLM at start: its extra config, its environment, its line
BAD = {
    "chunk": (
        {"chunk_tokens": 100},
        {},
        "chunk_tokens 100 is not a multiple of vLLM's block size 128",
    ),
    "store": ({"store": "ftp://nowhere/x"}, {}, "unknown store scheme 'ftp://'"),
    "key": ({"chunk_size": 256}, {}, "unknown kv_connector_extra_config key 'chunk_size'"),
}


@pytest.fixture(scope="module")
def bad_starts(
    vllm_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[VLLMServer, int]]:
    """A vLLM started with each bad setting, all at once (each dies after vLLM's imports and
    its config: ~30 s each one after another), waited for until each has exited."""
    started = {}
    for label, (extra, env, _) in BAD.items():
        folder = tmp_path_factory.mktemp(f"bad-{label}")
        started[label] = VLLMServer(
            f"bad-{label}",
            vllm_logs / f"bad-{label}.log",
            transfer=kvcloud_transfer_config(**extra),
            env={
                "KVCLOUD_STORE": f"file://{folder}/o",
                "KVCLOUD_INDEX": f"sqlite://{folder}/i.db",
                **env,
            },
        ).start()
    exits = {}
    for label, server in started.items():
        try:
            exits[label] = (server, server.wait_exit(timeout=240))
        finally:
            server.stop()
    return exits


@pytest.fixture(scope="module")
def servers(
    store: dict[str, str],
    vllm_logs: Path,
    checkpoint_other: Path,
    bad_starts: dict[str, tuple[VLLMServer, int]],
) -> Iterator[dict[str, VLLMServer]]:
    # (after the bad starts: three vLLMs starting at once beside these three would not fit
    # in this machine's memory with the session's reference)
    cfg = kvcloud_transfer_config()
    base = VLLMServer("N", vllm_logs / "N.log", transfer=cfg, env=store)
    other = VLLMServer("D", vllm_logs / "D.log", model=checkpoint_other, transfer=cfg, env=store)
    # bfloat16 weights and KV (eager bf16 text is off on this CPU build; only hits matter here)
    bf16 = VLLMServer(
        "E", vllm_logs / "E.log", transfer=cfg, env=store, args=["--dtype", "bfloat16"]
    )
    yield from serving(base, other, bf16)


def test_other_checkpoint_and_other_kv_dtype_get_no_hit(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    prompt = prompt_tokens(1400, seed=21)
    servers["N"].complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt) == len(prompt) // CHUNK
    for name in ("D", "E"):
        got = servers[name].complete([*prompt, 5, 6], max_tokens=2)
        assert cached_tokens(got) == 0, name
        m = servers[name].metrics()
        assert m.get("hit_tokens", 0) == 0 and m.get("loaded_tokens", 0) == 0, (name, m)
    # the control: the same prompt does hit on a server of the pushing kind
    again = servers["N"].complete([*prompt, 5, 6], max_tokens=2)
    assert cached_tokens(again) >= len(prompt) // CHUNK * CHUNK


@pytest.mark.parametrize("label", sorted(BAD))
def test_bad_settings_stop_vllm_at_start(
    label: str, bad_starts: dict[str, tuple[VLLMServer, int]]
) -> None:
    (server, rc), message = bad_starts[label], BAD[label][2]
    assert rc != 0
    lines = [ln for ln in server.log_text().splitlines() if "kvcloud connector cannot start" in ln]
    assert lines, server.log_tail()
    assert message in lines[0], lines[0]
    # the reason is a single line (the engine's traceback follows; the line says what to do)
    print(json.dumps({label: lines[0].split("kvcloud connector cannot start: ", 1)[1]}))
