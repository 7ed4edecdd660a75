"""The namespace and tenants of a vLLM process: what decides whether two vLLMs share KV.

Keys are kvcloud's own fingerprints over token ids, never vLLM's block hashes (their seed is
per process, so another machine could not find them). The namespace pins everything that
changes the KV bytes: a digest of the checkpoint's weight files and config (so a copy of the
checkpoint in another folder shares, a different checkpoint never does), the KV dtype, the
model's compute dtype, layers, KV heads, head size, and the version of this connector's
layout conversion. vLLM's block size is not in it: segments are converted to kvcloud's own
layout, so vLLMs with different ``--block-size`` share. K is stored after RoPE, so any rotary
embedding other than plain RoPE is pinned too (``rope_signature``): the rope parameters of the
checkpoint's config as vLLM reads them (``hf_overrides`` applied), and ``max_model_len`` where
the rope kind's output depends on it (Phi-3's LongRoPE switches on it).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...namespace import Namespace
from .._torch import dtype_name
from .checkpoints import checkpoint_digest, hub_snapshot
from .config import VLLMConnectorConfig
from .drafters import check_drafter, drafter_digest, drafter_layers
from .versions import SLEEP_MODE_REASON

LAYOUT_VERSION = "vllm-kv-v1"
_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _fp8_e4m3_name() -> str:
    """The e4m3 format vLLM's ``fp8`` means on this platform (``float8_e4m3fn``; ROCm's
    MI300 uses ``float8_e4m3fnuz``, whose bytes mean other values)."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.fp8_dtype()).removeprefix("torch.")
    except Exception:  # no vLLM platform (tests without vLLM): NVIDIA's and the CPU's
        return "float8_e4m3fn"


def kv_dtype_name(vllm_config: Any) -> str:
    """The namespace dtype of vLLM's KV cache: the model's, or the fp8 format of an fp8
    cache. An fp8 cache's bytes mean ``byte × scale``, its layers' K and V scales: vLLM 0.32
    reads them from the checkpoint (1.0 where it has none, never computed at run time), so
    the checkpoint digest in the namespace pins them with the weights (a ``weights_digest``
    set by hand must pin the scale tensors too)."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        name = dtype_name(vllm_config.model_config.dtype)
    else:
        name = {
            "float16": "float16",
            "half": "float16",
            "bfloat16": "bfloat16",
            "fp8": _fp8_e4m3_name(),
            "fp8_e4m3": _fp8_e4m3_name(),
            "fp8_e5m2": "float8_e5m2",
        }.get(cache_dtype, cache_dtype)
    if name not in _DTYPES:
        raise ConfigError(
            f"KV cache dtype {cache_dtype!r} ({name}): the kvcloud connector stores float32, "
            "float16, bfloat16 and fp8 KV (fp8, fp8_e4m3, fp8_e5m2 with per-tensor scales; "
            "not fp8_inc, fp8_ds_mla, per-token-head scales or e4m3fnuz)"
        )
    if name.startswith("float8"):
        if mla_dims(vllm_config.model_config) is not None:
            raise ConfigError(
                "an MLA model with an fp8 KV cache: its latent rows are quantized in a layout "
                "the kvcloud connector does not read; use --kv-cache-dtype auto"
            )
        if getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None):
            raise ConfigError(
                "kv_cache_dtype_skip_layers: some layers fp8, others not; the kvcloud "
                "connector stores one KV dtype for every layer"
            )
    return name


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, at start, what the connector would get wrong."""
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        # vLLM 0.33 asks the connector (supports_sleep_mode: False); 0.32 does not ask, and
        # frees the KV cache under the connector all the same: refused here for both
        raise ConfigError(SLEEP_MODE_REASON)
    pc = vllm_config.parallel_config
    if int(getattr(pc, "decode_context_parallel_size", 1) or 1) != 1:
        raise ConfigError("the kvcloud connector does not support decode context parallelism")
    if int(getattr(pc, "prefill_context_parallel_size", 1) or 1) != 1:
        raise ConfigError("the kvcloud connector does not support prefill context parallelism")
    if mla_dims(vllm_config.model_config) is not None and not getattr(
        vllm_config.cache_config, "enable_prefix_caching", False
    ):
        raise ConfigError(
            "an MLA model with vLLM's prefix caching off (vLLM turns it off for MLA on CPU): "
            "a prefix restored into vLLM's MLA context path changes greedy answers there "
            "(vLLM's own ExampleConnector too; docs/VLLM.md), so the kvcloud connector "
            "restores MLA caches only where vLLM's prefix caching is on for them"
        )
    check_drafter(vllm_config)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if any(_is_state(getattr(g, "kv_cache_spec", None)) for g in groups):
        raise ConfigError(MAMBA_REASON)
    group_windows(kv_cache_config)  # (refuses a kind of layer it cannot store)
    if len(groups) > 1 and drafter_layers(vllm_config, None):
        raise ConfigError(
            "speculative decoding with a drafter on a model with several KV cache groups "
            "(vLLM's hybrid allocator): the kvcloud connector stores a drafter's layers in "
            "one group only; set --disable-hybrid-kv-cache-manager or serve without it"
        )


MAMBA_REASON = (
    "a model with Mamba or linear-attention layers: their cache is one fixed-size state per "
    "request (convolution and SSM state), not KV per token, and a prefix's state exists "
    "only at the boundaries vLLM checkpoints it (prefix caching's mamba_cache_mode 'align'). "
    "The kvcloud connector follows several KV cache groups (SupportsHMA) but stores "
    "attention KV only; it would also need a state per chunk boundary in the store beside "
    "the attention KV, and to restore the state at the restore point only, so it refuses "
    "these models"
)


def _is_state(spec: Any) -> bool:
    """Is a KV cache group's spec a recurrent state (Mamba, linear attention), directly or
    inside vLLM's per-layer wrapper (``UniformTypeKVCacheSpecs``)?"""
    if spec is None:
        return False
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict):
        return any(_is_state(s) for s in inner.values())
    return any(cls.__name__ == "MambaSpec" for cls in type(spec).__mro__)


def mla_dims(mc: Any) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of an MLA model, None for any other.

    An MLA layer caches one latent row per token, the same on every TP rank (it is computed by
    replicated layers). kvcloud stores it as one KV head of half the row's width, K the row's
    first half and V its second: a chunk is stored once (by the first rank) and every rank
    pulls all of it."""
    if not getattr(mc, "use_mla", False):
        return None
    hf = getattr(mc, "hf_text_config", None) or mc.hf_config
    lora, rope = int(hf.kv_lora_rank), int(getattr(hf, "qk_rope_head_dim", 0) or 0)
    if (lora + rope) % 2:
        raise ConfigError(
            f"an MLA latent of {lora} + {rope} values per token: kvcloud stores it as two "
            "halves and cannot split an odd width"
        )
    return lora, rope


# kinds of KV cache group whose blocks hold every token's KV until the request ends
_WHOLE = ("FullAttentionSpec", "MLAAttentionSpec", "UniformTypeKVCacheSpecs")
# kinds that free or reuse blocks under a request in ways the connector does not follow
_REUSED = (
    "ChunkedLocalAttentionSpec", "RSWASpec", "CircularBufferSpec", "SlidingWindowMLASpec",
    "HiSparseHotSpec", "HiSparseResidentSpec", "CrossAttentionSpec",
)  # fmt: skip


def group_windows(kv_cache_config: Any) -> list[int | None]:
    """Per KV cache group (vLLM's hybrid allocator makes one per kind of layer): its sliding
    window, whose blocks behind it become vLLM's shared null block, or None where every
    block is kept. A ConfigError for a kind the connector would store wrong."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    windows = [_window(getattr(g, "kv_cache_spec", None), len(groups)) for g in groups]
    sizes = {getattr(getattr(g, "kv_cache_spec", None), "block_size", None) for g in groups}
    if len(sizes) > 1:
        raise ConfigError(
            "KV cache groups with different block sizes: the kvcloud connector stores a "
            "chunk as whole blocks of one size in every group"
        )
    return windows


def _window(spec: Any, groups: int) -> int | None:
    kind = type(spec).__name__
    inner = getattr(spec, "kv_cache_specs", None)
    if kind == "UniformTypeKVCacheSpecs" and isinstance(inner, dict) and inner:
        # one group of layers of one kind but several shapes (vLLM packs them on the
        # worker): the kind of its layers decides, and they must agree
        found = {_window(s, groups) for s in inner.values()}
        if len(found) > 1:
            raise ConfigError(f"a KV cache group mixing windows {sorted(map(str, found))}")
        return found.pop()
    # only vLLM's SlidingWindowSpec frees blocks behind the window: FullAttentionSpec keeps
    # a sliding_window attribute when the hybrid allocator is off, and keeps every block
    if kind == "SlidingWindowSpec" and getattr(spec, "sliding_window", None):
        return int(spec.sliding_window)
    if kind in _REUSED or (groups > 1 and kind not in _WHOLE):
        raise ConfigError(
            f"a KV cache group of {kind} layers ({groups} groups): the kvcloud connector "
            "stores full and sliding-window attention only"
        )
    return None


def sliding_window(kv_cache_config: Any) -> int | None:
    """The smallest window of the model's sliding KV cache groups (their blocks out of the
    window become vLLM's shared null block), None when no group slides."""
    windows = [w for w in group_windows(kv_cache_config) if w is not None]
    return min(windows) if windows else None


# -- the rotary embedding vLLM applies to K ---------------------------------------------------

# Keys of plain RoPE: cos/sin depend on theta and the rotated width only, both read from the
# checkpoint's config (pinned by its digest, or by ``hf_overrides``), never on max_model_len.
_PLAIN_ROPE_KEYS = frozenset({"rope_type", "rope_theta", "partial_rotary_factor"})
# the names vLLM's ``patch_rope_parameters`` reads for theta and the rotated fraction
_THETA_NAMES = ("rope_theta", "rotary_emb_base")
_FRACTION_NAMES = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")
# fields beside the rope parameters that vLLM's rope classes or its models read
_ROPE_FIELDS = (
    "original_max_position_embeddings",
    "max_position_embeddings",
    "max_trained_positions",
    "rotary_dim",
    "head_dim",
    "rope_local_base_freq",
    "dual_chunk_attention_config",
)
# where a multimodal checkpoint keeps its language model's config (vLLM: get_hf_text_config)
_TEXT_SECTIONS = ("text_config", "llm_config", "language_config")


def _canonical(value: Any) -> Any:
    """Numbers as floats (a config's ``10000`` and ``10000.0`` rotate alike), containers
    recursively, so only a difference vLLM would act on changes the digest."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return str(value)


def _first(fields: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((fields[n] for n in names if fields.get(n) is not None), None)


def _rope_layers(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rope parameters vLLM hands ``get_rope``, one dict per layer type ("" if shared),
    from a text config's fields.

    As vLLM 0.32 reads them (``transformers_utils/config.py``): ``rope_parameters`` when the
    config has it (transformers 5 folds ``rope_theta``, ``rope_scaling`` and
    ``partial_rotary_factor`` into it), else ``rope_scaling`` with theta and the rotated
    fraction under any of their legacy names (``patch_rope_parameters``); the legacy ``type``
    key becomes ``rope_type`` and ``su`` becomes ``longrope`` (``patch_legacy_rope_type``)."""
    params = fields.get("rope_parameters")
    if isinstance(params, dict) and params:
        nested = all(isinstance(v, dict) for v in params.values())  # per layer type
        layers = {str(k): dict(v) for k, v in params.items()} if nested else {"": dict(params)}
    else:
        scaling = fields.get("rope_scaling")
        layer = dict(scaling) if isinstance(scaling, dict) else {}
        theta, fraction = _first(fields, _THETA_NAMES), _first(fields, _FRACTION_NAMES)
        if theta is not None:
            layer.setdefault("rope_theta", theta)
        if fraction is not None:
            layer.setdefault("partial_rotary_factor", fraction)
        layers = {"": layer} if layer else {}
    for layer in layers.values():
        legacy = layer.pop("type", None)  # transformers keeps the legacy key beside rope_type
        kind = str(layer.get("rope_type") or legacy or "default")
        layer["rope_type"] = "longrope" if kind == "su" else kind
    return layers


def _is_plain(layer: dict[str, Any]) -> bool:
    return layer["rope_type"] == "default" and set(layer) <= _PLAIN_ROPE_KEYS


def _max_len_dependence(
    layer: dict[str, Any], fields: dict[str, Any], max_model_len: int
) -> str | None:
    """What of ``max_model_len`` this layer's rotation depends on in vLLM 0.32, or None.

    - ``longrope`` (Phi-3's LongRoPE; ``phi3_long_rope_scaled_rope.py``): vLLM rotates every
      position with the long factors when ``max_model_len > original_max_position_embeddings``
      and with the short ones otherwise, so two vLLMs on either side of that line compute
      different K for the same tokens, two on the same side the same K;
    - ``dynamic`` NTK with ``max_trained_positions`` (``dynamic_ntk_scaling_rope.py``): the
      base is scaled by ``max_position / max_trained_positions``, and some models pass
      ``max_model_len`` as ``max_position`` (without ``max_trained_positions`` get_rope sets
      it to ``max_position`` and the base is unscaled).
    Every other kind (default, linear, ntk, llama3, yarn, deepseek_yarn, mrope, ...) sizes
    its cos/sin table by ``max_position`` but computes each position's row alike.
    """
    kind = layer["rope_type"]
    if kind == "longrope":
        original = layer.get("original_max_position_embeddings") or fields.get(
            "original_max_position_embeddings"
        )
        if original:
            return "long" if max_model_len > int(original) else "short"
        return f"max_model_len={max_model_len}"
    trained = layer.get("max_trained_positions") or fields.get("max_trained_positions")
    if kind == "dynamic" and "factor" in layer and trained:
        return f"max_model_len={max_model_len}"
    return None


def _merge(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """``hf_overrides`` onto a config dict as vLLM applies them: a dict onto a nested config
    key by key (``_apply_dict_overrides``), anything else replaced."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict) and key in _TEXT_SECTIONS:
            _merge(config[key], value)
        else:
            config[key] = value


def _checkpoint_text_config(mc: Any) -> dict[str, Any] | None:
    """The checkpoint's own text config (config.json, ``hf_overrides`` applied), or None
    where there is none to read (a GGUF file, Mistral's params.json, a hub model not in the
    local cache).

    Read from the file, not from ``mc.hf_text_config``: vLLM's models edit that object in
    place when they are built (``deepseek_v2.py`` turns ``yarn`` into ``deepseek_yarn``,
    ``glm4.py`` adds ``partial_rotary_factor``, ...), and they are built in the worker
    processes, after the config was sent there, never in the engine-core process that runs
    the scheduler side: a digest of that object would give the two sides of one vLLM
    different namespaces. The file is the same for both."""
    source = str(getattr(mc, "hf_config_path", None) or mc.model)
    folder: Path | None = Path(source)
    if not folder.is_dir():
        folder = hub_snapshot(source, getattr(mc, "revision", None))
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    overrides = getattr(mc, "hf_overrides", None)
    if isinstance(overrides, dict):
        _merge(config, overrides)
    for section in _TEXT_SECTIONS:
        text = config.get(section)
        if isinstance(text, dict) and any(
            k in text for k in ("rope_parameters", "rope_scaling", *_THETA_NAMES)
        ):
            return text
    return config


def _loaded_text_config(mc: Any) -> dict[str, Any]:
    """The rope fields of vLLM's loaded text config (the fallback: see _checkpoint_text_config
    for why only the long/short switch is taken from it)."""
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    names = ("rope_parameters", "rope_scaling", *_THETA_NAMES, *_FRACTION_NAMES, *_ROPE_FIELDS)
    return {n: getattr(text, n) for n in names if getattr(text, n, None) is not None}


def rope_signature(model_config: Any) -> str | None:
    """What of the rotary embedding vLLM applies to K pins the namespace; None for plain RoPE.

    K is stored after RoPE, so two vLLMs share KV only where they rotate alike. For a rope
    other than plain RoPE it is the rope kind, ``max_model_len``'s part where the kind's
    output depends on it (``_max_len_dependence``: LongRoPE's long/short switch), and a
    digest of every layer type's rope parameters with the fields vLLM's rope classes read
    beside them, after ``hf_overrides``. Plain RoPE gives None, so the namespace of a plain
    deployment is the one it always had: its theta and rotated width are in config.json,
    which the checkpoint digest (or ``hf_overrides``) already pins, and no max_model_len
    changes it. Where the checkpoint's config.json cannot be read, only the long/short
    switch is taken (from vLLM's loaded config; see _checkpoint_text_config).
    """
    fields = _checkpoint_text_config(model_config)
    from_file = fields is not None
    if fields is None:
        fields = _loaded_text_config(model_config)
    layers = _rope_layers(fields)
    dual_chunk = fields.get("dual_chunk_attention_config")
    if all(_is_plain(layer) for layer in layers.values()) and not dual_chunk:
        return None
    max_model_len = int(getattr(model_config, "max_model_len", 0) or 0)
    depends = {
        name: dep
        for name, layer in layers.items()
        if (dep := _max_len_dependence(layer, fields, max_model_len)) is not None
    }
    # the kinds and the long/short switch in clear, for whoever reads a namespace in a log
    kinds = "+".join(sorted({layer["rope_type"] for layer in layers.values()})) or "none"
    switch = ",".join(sorted(set(depends.values())))
    label = f"{kinds}@{switch}" if switch else kinds
    if not from_file:
        return label if switch else None
    signature = {
        "layers": _canonical(layers),
        "fields": _canonical({n: fields[n] for n in _ROPE_FIELDS if n in fields}),
        "max_len": depends,
    }
    digest = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:32]
    return f"{label}:{digest}"


def vllm_namespace(
    vllm_config: Any, cfg: VLLMConnectorConfig, kv_cache_config: Any = None
) -> Namespace:
    mc = vllm_config.model_config
    hf = mc.hf_config
    extra = {
        "layout": LAYOUT_VERSION,
        "compute_dtype": dtype_name(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
    }
    # settings that change the KV bytes for the same weights and tokens; added only when
    # set, so the namespace of a plain deployment stays what it was
    overrides = getattr(mc, "hf_overrides", None)
    if overrides and not callable(overrides):
        extra["hf_overrides"] = json.dumps(overrides, sort_keys=True, default=str)
    elif callable(overrides):
        # a function cannot be compared across processes: pin what it produced instead
        extra["hf_config"] = hashlib.sha256(hf.to_json_string().encode()).hexdigest()
    rope = rope_signature(mc)
    if rope is not None:
        # post-RoPE K depends on vLLM's effective rope (and, for LongRoPE, max_model_len)
        extra["rope"] = rope
    impl = str(getattr(mc, "model_impl", "auto") or "auto")
    if impl not in ("auto", "vllm", "ModelImpl.AUTO", "ModelImpl.VLLM"):
        extra["model_impl"] = impl
    # the whole model's KV heads, whatever the TP size: every TP size shares
    heads, head_dim = int(mc.get_total_num_kv_heads()), int(mc.get_head_size())
    mla = mla_dims(mc)
    if mla is not None:
        # one latent row per token, stored as one head of two halves (see mla_dims)
        extra["mla"] = f"latent={mla[0]},rope={mla[1]}"
        heads, head_dim = 1, (mla[0] + mla[1]) // 2
    drafted = drafter_layers(vllm_config, kv_cache_config)
    if drafted:
        # a drafter's layers are stored after the target's, in the same chunk: its KV must
        # come back with the target's (a restore without it changes the proposals), and
        # another drafter's KV is another namespace
        extra["drafter"] = drafter_digest(vllm_config)
    return Namespace(
        model=f"vllm/{getattr(hf, 'model_type', 'unknown')}",
        # the whole model's layers, whatever the pipeline split: every PP size shares;
        # then the drafter's, if any
        num_layers=int(mc.get_total_num_hidden_layers()) + drafted,
        num_kv_heads=heads,
        head_dim=head_dim,
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


# -- what else vLLM's block hash covers ---------------------------------------------------------

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_adapter_digests: dict[tuple[str, int, int], str] = {}  # oldest first, at most _ADAPTERS_KEPT
_ADAPTERS_KEPT = 1024  # adapters (and versions of one) a server has seen; each entry ~200 bytes
_adapter_lock = threading.Lock()  # lookup threads digest concurrently


def adapter_digest(path: str) -> str:
    """SHA-256 over a LoRA adapter's config and weight files (names and bytes), cached by
    path, size and mtime: an adapter name re-pointed at other weights gets another digest."""
    folder = Path(path)
    files = [folder / name for name in _ADAPTER_FILES if (folder / name).is_file()]
    if not files:
        raise ConfigError(f"LoRA adapter {path!r}: no adapter files to digest")
    stat = [f.stat() for f in files]
    cache_key = (
        str(folder.resolve()),
        sum(s.st_size for s in stat),
        max(s.st_mtime_ns for s in stat),
    )
    with _adapter_lock:
        digest = _adapter_digests.get(cache_key)
    if digest is None:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
        digest = h.hexdigest()
        with _adapter_lock:
            _adapter_digests[cache_key] = digest
            while len(_adapter_digests) > _ADAPTERS_KEPT:  # adapters re-pointed for weeks
                del _adapter_digests[next(iter(_adapter_digests))]
    return digest


class SkipRequest(Exception):
    """This request's KV cannot be keyed by kvcloud (vLLM's cache would not share it either,
    or kvcloud cannot tell): it runs without the connector. The message says why."""


def request_scope(base: str, request: Any) -> str:
    """The tenant a request's fingerprints are made with: everything besides the token ids
    that vLLM's own block hash covers (``v1/core/kv_cache_utils.py``,
    ``generate_block_hash_extra_keys``) is folded in, so two requests share KV in kvcloud only
    where vLLM's prefix cache would share it too:

    - ``cache_salt``;
    - the LoRA adapter: its name and a digest of its weights (vLLM: name and path);
    - multimodal inputs: each feature's identifier (vLLM's hash of the item) with its
      placeholder position and length, for the whole prompt (vLLM keys only the blocks from
      the item on; kvcloud's chain covers every chunk, so this is stricter, never looser).

    Prompt embeddings have no token ids to fingerprint: ``SkipRequest``.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        raise SkipRequest("prompt embeddings (no token ids to fingerprint)")
    tenant = request_tenant(base, getattr(request, "cache_salt", None))
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        if not path:
            raise SkipRequest(f"LoRA adapter {lora.lora_name!r} has no local path to digest")
        try:
            digest = adapter_digest(str(path))
        except (OSError, ConfigError) as exc:
            raise SkipRequest(f"LoRA adapter {lora.lora_name!r}: {exc}") from None
        parts.append(f"lora={lora.lora_name}:{digest}")
    features = getattr(request, "mm_features", None) or []
    if features:
        h = hashlib.sha256()
        for feature in features:
            ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
            if not ident:
                raise SkipRequest("a multimodal input without a hash")
            pos = feature.mm_position
            h.update(f"{ident}@{int(pos.offset)}+{int(pos.length)}\0".encode())
        parts.append(f"mm={h.hexdigest()[:32]}")
    if not parts:
        return tenant
    scope = hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
    return f"{tenant}#x={scope}"
