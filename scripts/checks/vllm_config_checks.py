"""Checks of the kvcloud connector against vLLM's own classes that need no model and no
server: only vLLM's import (~20-60 s of CPU here). tests/vllm/test_vllm_config_checks.py runs
them all in one process and asserts on what each reports, so the test suite (whose venv has
no vLLM) runs them for real, and this venv needs no pytest.

Checks (one a function; each reports facts, the test judges them):

- ``longrope``: vLLM's Phi-3 LongRoPE rotates the same tokens' K differently at a
  max_model_len above ``original_max_position_embeddings`` than below it, alike on one side;
  and the namespaces built from vLLM's own ``ModelConfig`` follow (a Phi-3 LongRoPE model's
  rope is in the namespace, a plain-RoPE Llama's is not).
- ``sleep_hooks``: the connector answers vLLM 0.33's sleep-mode hooks (``supports_sleep_mode``
  no; ``release_kv_caches`` / ``unregister_kv_caches`` refuse; ``restore_kv_caches`` nothing).
- ``version_check``: the connector checks the vLLM version first thing at start.
- ``cudagraph_modes``: which of vLLM's ``CUDAGraphMode`` values the worker side reads as full
  CUDA graphs (a step a graph may replay, so no per-layer hook runs).

Prints one JSON line per check, ``{"check": name, "result": {...}}`` or
``{"check": name, "error": traceback}``, after one ``{"check": "env", ...}`` line naming the
vLLM version and the kvcloud imported; exits 1 when any check raised. Run with the vLLM
venv, this checkout's kvcloud first on the path::

    PYTHONPATH=. .venv-vllm/bin/python scripts/checks/vllm_config_checks.py [CHECK ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# a Phi-3 LongRoPE checkpoint's rope (tests/unit/test_vllm_settings.py uses it too)
LONGROPE = {
    "model_type": "phi3",
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4},
}


def _setup_env() -> None:
    """Before vLLM is imported: the test servers' settings (offline, caches under .cache),
    quiet logs (vLLM logs to stdout)."""
    from scripts.fleet.vllm_fleet import vllm_env

    os.environ.update(vllm_env())
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _outcome(call: Callable[[], Any]) -> dict[str, Any]:
    """What a call did: ``{"returned": repr}`` or ``{"raised": type, "connector_error": is it
    a KVCloudConnectorError, "message": str}``."""
    from kvcloud.integrations.vllm.connector import KVCloudConnectorError

    try:
        value = call()
    except Exception as exc:
        return {
            "raised": type(exc).__name__,
            "connector_error": isinstance(exc, KVCloudConnectorError),
            "message": str(exc),
        }
    return {"returned": repr(value)}


def check_longrope() -> dict[str, Any]:
    import torch
    from vllm.config import ModelConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import Phi3LongRoPEScaledRotaryEmbedding

    from kvcloud.integrations.vllm.config import VLLMConnectorConfig
    from kvcloud.integrations.vllm.keys import vllm_namespace

    def post_rope_k(max_model_len: int) -> torch.Tensor:
        current = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len))
        with set_current_vllm_config(current):  # what the rope reads max_model_len from
            rope = Phi3LongRoPEScaledRotaryEmbedding(
                8, 8, 16384, 4096, 10000.0, True, torch.float32, [1.0] * 4, [4.0] * 4
            )
        return rope(torch.arange(16), torch.ones(16, 8), torch.ones(16, 8))[1]

    k = {n: post_rope_k(n) for n in (4096, 8192, 16384)}
    same_k = {f"{a}={b}": bool(torch.equal(k[a], k[b])) for a, b in ((4096, 8192), (8192, 16384))}

    arch = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 256, "torch_dtype": "float32"}  # fmt: skip
    # a factor per rotated pair: 64 / 4 heads = 16 wide, 8 pairs
    phi3 = {**arch, **LONGROPE,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                             "long_factor": [4.0] * 8}}  # fmt: skip
    llama = {**arch, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "rope_theta": 10000.0, "max_position_embeddings": 4096}  # fmt: skip
    namespaces: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvcloud-longrope-") as tmp:
        for name, config, lengths in (("phi3", phi3, (4096, 8192, 16384)),
                                      ("llama", llama, (1024, 4096))):  # fmt: skip
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            for n in lengths:
                mc = ModelConfig(model=str(folder), tokenizer=str(folder),
                                 skip_tokenizer_init=True, max_model_len=n,
                                 dtype="float32")  # fmt: skip
                vc = SimpleNamespace(
                    model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto")
                )
                ns = vllm_namespace(vc, VLLMConnectorConfig(weights_digest="sha256-x"))
                namespaces[f"{name}:{n}"] = {
                    "id": ns.id,
                    "rope_in_extra": '"rope"' in ns.extra,
                    "extra": ns.extra,
                }
    return {"same_k": same_k, "namespaces": namespaces}


def check_sleep_hooks() -> dict[str, Any]:
    from kvcloud.integrations.vllm.connector import KVCloudConnector

    dummy = object.__new__(KVCloudConnector)  # the hooks use no state
    return {
        "supports_sleep_mode(config)": _outcome(
            lambda: KVCloudConnector.supports_sleep_mode(SimpleNamespace())
        ),
        "supports_sleep_mode()": _outcome(KVCloudConnector.supports_sleep_mode),
        "release_kv_caches": _outcome(dummy.release_kv_caches),
        "unregister_kv_caches": _outcome(dummy.unregister_kv_caches),
        "restore_kv_caches": _outcome(dummy.restore_kv_caches),
    }


def check_version_check() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcloud.integrations.vllm import versions
    from kvcloud.integrations.vllm.connector import KVCloudConnector

    seen: list[str] = []
    original = versions.check_vllm_version
    versions.check_vllm_version = lambda *_: seen.append("checked")  # type: ignore[assignment]
    try:
        vc = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"chunk_tokens": 24}),
            cache_config=SimpleNamespace(block_size=16),
        )
        # a setting that stops the start right after the check: the check ran first
        start = _outcome(lambda: KVCloudConnector(vc, KVConnectorRole.SCHEDULER, None))
    finally:
        versions.check_vllm_version = original  # type: ignore[assignment]
    return {"start": start, "seen": seen}


def check_cudagraph_modes() -> dict[str, Any]:
    from vllm.config.compilation import CUDAGraphMode

    from kvcloud import KVCloud, Namespace
    from kvcloud.integrations.vllm.config import VLLMConnectorConfig
    from kvcloud.integrations.vllm.worker import WorkerSide

    # tests.helpers.make_ns("float32"): 2 layers, 2 heads × 8, 16-token chunks
    ns = Namespace(model="test-model", revision="r1", num_layers=2, num_kv_heads=2,
                   head_dim=8, dtype="float32", chunk_tokens=16)  # fmt: skip
    full_graphs: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="kvcloud-cudagraph-") as tmp:
        kvc = KVCloud.open(store=f"file://{tmp}/o", index=f"sqlite://{tmp}/i.db")
        for mode in CUDAGraphMode:
            vllm_config = SimpleNamespace(
                cache_config=SimpleNamespace(block_size=8),
                compilation_config=SimpleNamespace(cudagraph_mode=mode),
                model_config=SimpleNamespace(enforce_eager=False),
            )
            cfg = VLLMConnectorConfig(write_policy="off")
            ws = WorkerSide(cfg, ns, kvc, vllm_config, SimpleNamespace())
            full_graphs[mode.name] = bool(ws.full_graphs)
    return {"full_graphs": full_graphs}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "longrope": check_longrope,
    "sleep_hooks": check_sleep_hooks,
    "version_check": check_version_check,
    "cudagraph_modes": check_cudagraph_modes,
}


def _emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checks", nargs="*", help=f"of {', '.join(CHECKS)} (default: all)")
    a = p.parse_args(argv)
    unknown = [c for c in a.checks if c not in CHECKS]
    if unknown:
        p.error(f"no check {', '.join(unknown)}: use {', '.join(CHECKS)}")
    _setup_env()
    import vllm

    import kvcloud

    _emit({"check": "env", "vllm": vllm.__version__, "kvcloud": kvcloud.__file__})
    failed = []
    for name in a.checks or list(CHECKS):
        try:
            _emit({"check": name, "result": CHECKS[name]()})
        except Exception:
            failed.append(name)
            _emit({"check": name, "error": traceback.format_exc()})
    if failed:
        print(f"vllm_config_checks: {', '.join(failed)} raised", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
