"""Speculative decoding with a drafter whose KV layers live in vLLM's cache beside the
target's (EAGLE, EAGLE-3, MTP): which drafters are stored, how many layers they add, and what
in the namespace names them. docs/VLLM.md, "What is supported", has why each rule is there.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from .checkpoints import checkpoint_digest

# drafters whose KV layers follow the target's (named after them): stored with them.
# vLLM's use_eagle() also covers dflash (a non-causal drafter) and dspark (layers numbered
# from 0): not these.
DRAFTER_METHODS = ("eagle", "eagle3", "mtp")


def drafter_cuts_last_block(vllm_config: Any) -> bool:
    """Whether a hit ending where its stored chunks end leaves its last block to be
    computed: where vLLM drops the last block of its own prefix hit for the drafter
    (``use_eagle_block_drop``; off with ``disable_eagle_block_drop``), for the same reason."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not draft_kv(spec):
        return False
    drop = getattr(spec, "use_eagle_block_drop", None)
    return bool(drop()) if callable(drop) else True


def drafter_layers(vllm_config: Any, kv_cache_config: Any = None) -> int:
    """KV layers a speculative drafter adds to vLLM's cache (EAGLE's draft layer, MTP's
    layers): 0 without one. vLLM names them after the target's (EAGLE's first is
    ``model.layers.<target layers>``), in the one cache group; counted from that group's
    layer names, else from the draft model's config."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not draft_kv(spec):
        return 0
    target = int(vllm_config.model_config.get_total_num_hidden_layers())
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if groups and getattr(groups[0], "layer_names", None):
        return max(0, len(groups[0].layer_names) - target)
    draft = getattr(spec, "draft_model_config", None)
    return int(draft.get_total_num_hidden_layers()) if draft is not None else 1


def drafter_digest(vllm_config: Any) -> str:
    """What pins a drafter's KV: its method and its checkpoint (an MTP head inside the
    target's own checkpoint is pinned by the target's digest)."""
    spec = vllm_config.speculative_config
    method = str(getattr(spec, "method", "") or "")
    draft = getattr(spec, "draft_model_config", None)
    model = str(getattr(draft, "model", "") or "")
    mc = vllm_config.model_config
    # an MTP head's "draft model" is the target's checkpoint (model or model_weights)
    if not model or model in (str(mc.model), str(getattr(mc, "model_weights", "") or "")):
        return method
    return f"{method}:{checkpoint_digest(model, getattr(draft, 'revision', None))}"


def draft_kv(spec: Any) -> bool:
    """Does the speculative method bring KV layers of its own (EAGLE, MTP, a draft model)?
    vLLM answers it (``uses_draft_kv_cache``); ngram and suffix decoding have none."""
    probe = getattr(spec, "uses_draft_kv_cache", None)
    if callable(probe):
        return bool(probe())
    return str(getattr(spec, "method", "")) not in ("ngram", "ngram_gpu", "suffix")


def check_drafter(vllm_config: Any) -> None:
    """Refuse, at start, a speculative drafter the connector would store wrongly."""
    pc = vllm_config.parallel_config
    spec = getattr(vllm_config, "speculative_config", None)
    method = str(getattr(spec, "method", "") or "") if spec is not None else ""
    if spec is not None and draft_kv(spec):
        if method not in DRAFTER_METHODS:
            raise ConfigError(
                f"speculative decoding with {method}: the kvcloud connector stores the KV "
                "of EAGLE, EAGLE-3 and MTP drafters (their layers follow the target's), "
                "not of a separate draft model; use one of those or ngram/suffix decoding"
            )
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
            raise ConfigError(
                f"speculative decoding ({method}) with pipeline parallelism: the drafter's "
                "layers live on the last stage only; the kvcloud connector does not split them"
            )
        draft = getattr(spec, "draft_model_config", None)
        mc = vllm_config.model_config
        if draft is not None and (
            int(draft.get_total_num_kv_heads()) != int(mc.get_total_num_kv_heads())
            or int(draft.get_head_size()) != int(mc.get_head_size())
        ):
            # (vLLM still puts such a drafter in the one cache group, as per-layer specs)
            raise ConfigError(
                f"a {method} drafter with KV heads of another shape than the target's: the "
                "kvcloud connector stores every layer of a chunk in one shape"
            )
