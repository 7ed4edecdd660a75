"""The namespace and tenants of a vLLM process: what decides whether two vLLMs share KV.

Keys are kvcloud's own fingerprints over token ids, never vLLM's block hashes (their seed is
per process, so another machine could not find them). The namespace pins everything that
changes the KV bytes: a digest of the checkpoint's weight files and config (so a copy of the
checkpoint in another folder shares, a different checkpoint never does), the KV dtype, the
model's compute dtype, layers, KV heads, head size, and the version of this connector's
layout conversion. vLLM's block size is not in it: segments are converted to kvcloud's own
layout, so vLLMs with different ``--block-size`` share.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...namespace import Namespace
from .._torch import dtype_name
from .config import VLLMConnectorConfig

LAYOUT_VERSION = "vllm-kv-v1"
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def checkpoint_digest(model: str, revision: str | None = None) -> str:
    """SHA-256 over a local checkpoint's weight files and config.json (names and bytes); for a
    hub id, the id and revision (vLLM pins the files it downloads by revision)."""
    path = Path(model)
    if not path.is_dir():
        return "hub:" + hashlib.sha256(f"{model}@{revision or 'main'}".encode()).hexdigest()
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise ConfigError(f"{model}: no weight files (*.safetensors, *.bin) to pin the namespace")
    config = path / "config.json"
    h = hashlib.sha256()
    for f in [*files, *([config] if config.is_file() else [])]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return "sha256-" + h.hexdigest()


def kv_dtype_name(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        name = dtype_name(vllm_config.model_config.dtype)
    else:
        name = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16"}.get(
            cache_dtype, cache_dtype
        )
    if name not in _DTYPES:
        raise ConfigError(
            f"KV cache dtype {cache_dtype!r}: the kvcloud connector stores float32, float16 "
            "or bfloat16 KV (quantized fp8 caches need per-layer scales it does not carry yet)"
        )
    return name


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, at start, what the connector would get wrong."""
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConfigError(
            "the kvcloud connector supports tensor_parallel_size=1 and "
            "pipeline_parallel_size=1 for now (per-shard namespaces are not built yet)"
        )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ConfigError("the kvcloud connector does not support MLA attention caches yet")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ConfigError(
            f"the model has {len(groups)} KV cache groups (hybrid or sliding-window layers); "
            "the kvcloud connector supports one group of full-attention layers"
        )


def vllm_namespace(vllm_config: Any, cfg: VLLMConnectorConfig) -> Namespace:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    hf = mc.hf_config
    extra = {
        "layout": LAYOUT_VERSION,
        "compute_dtype": dtype_name(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
    }
    return Namespace(
        model=f"vllm/{getattr(hf, 'model_type', 'unknown')}",
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_dim=int(mc.get_head_size()),
        revision=cfg.weights_digest or checkpoint_digest(mc.model, getattr(mc, "revision", None)),
        dtype=kv_dtype_name(vllm_config),
        chunk_tokens=cfg.chunk_tokens,
        extra=json.dumps(extra, sort_keys=True),
    )


def request_tenant(base: str, cache_salt: str | None) -> str:
    """The tenant whose key fingerprints a request: the configured tenant, with the request's
    ``cache_salt`` folded in (derived here, in the engine, never taken from the caller as a
    key), so requests with different salts can never find each other's KV."""
    if not cache_salt:
        return base
    salt = hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:32]
    return f"{base}#salt={salt}"
