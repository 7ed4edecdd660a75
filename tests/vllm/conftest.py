"""Real vLLM OpenAI servers (``.venv-vllm``) with and without the kvcloud connector.

Starting vLLM takes ~40 s here and each server holds ~3.3 GB, so servers are shared: one
no-connector reference for the whole session, the rest per test module, each module's
servers started together and torn down before the next module starts its own. At most three
per module: with the reference and the suite's own process (~4 GB by then) a fourth does
not fit in 24 GiB (seen: the kernel killed pytest when one module ran five).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fleet.vllm_fleet import SMOLLM2, VLLM_PYTHON, VLLMServer

if not VLLM_PYTHON.exists() or not (SMOLLM2 / "config.json").exists():
    raise RuntimeError(
        f"vLLM tests need {VLLM_PYTHON} and {SMOLLM2}: run `make install-vllm` (make test does)"
    )


def start_all(*servers: VLLMServer) -> list[VLLMServer]:
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready()
    except Exception:
        for s in servers:
            s.stop()
        raise
    return list(servers)


def serving(*servers: VLLMServer) -> Iterator[dict[str, VLLMServer]]:
    """Start servers together, hand them out by name, stop them all (a fixture body)."""
    started = start_all(*servers)
    try:
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.stop()


def embedded_env(folder: Path, secret: str) -> dict[str, str]:
    """kvcloud's embedded default (file:// + sqlite://) in ``folder``."""
    return {
        "KVCLOUD_STORE": f"file://{folder}/objects",
        "KVCLOUD_INDEX": f"sqlite://{folder}/index.db",
        "KVCLOUD_SECRET": secret,
    }


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def reference(vllm_logs: Path) -> Iterator[VLLMServer]:
    """vLLM without any connector: the independent reference for every answer."""
    (server,) = start_all(VLLMServer("R", vllm_logs / "R.log", in_process=True))
    yield server
    server.stop()


def prompt_tokens(n: int, seed: int) -> list[int]:
    """Token ids of ordinary text-like tokens (SmolLM2's vocabulary is 49,152)."""
    rng = random.Random(seed)
    return [rng.randrange(200, 48_000) for _ in range(n)]


@pytest.fixture(scope="session")
def checkpoint_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint in another folder: must share KV."""
    dst = tmp_path_factory.mktemp("ckpt") / "smollm2-copy"
    shutil.copytree(SMOLLM2, dst)
    return dst


@pytest.fixture(scope="session")
def checkpoint_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different checkpoint with the same shape (one weight nudged): must never share."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = tmp_path_factory.mktemp("ckpt") / "smollm2-other"
    shutil.copytree(SMOLLM2, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(SMOLLM2 / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("layers.0.self_attn.k_proj.weight"))
    bits = tensors[name].view(torch.int16).clone()
    bits[0, :8] ^= 1  # flip the lowest mantissa bit of a few bf16 weights
    tensors[name] = bits.view(tensors[name].dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
