"""Push and pull the KV cache of a Hugging Face ``transformers`` causal LM through kvcloud.

The few lines a generation loop gains::

    from kvcloud import KVCloud
    from kvcloud.integrations.transformers import KVCloudCache

    kvc = KVCloudCache(KVCloud.open(store=..., index=...), model)
    cache, restored = kvc.restore(input_ids)    # KV of the longest stored prefix (maybe none)
    out = model.generate(input_ids, **kvc.generate_kwargs(cache), max_new_tokens=64)
    kvc.save(out, cache)                        # push the full chunks the cache now covers

``restore`` returns a transformers ``DynamicCache`` holding the restored prefix; ``generate``
computes only the tokens after it and extends the same cache object in place, which ``save``
then pushes. The namespace pins the model: its type, a SHA-256 digest of its weights, its KV
geometry and dtype, and every config field that can change the KV, so two checkpoints (or two
RoPE settings of one checkpoint) never share KV.

torch and transformers are imported inside the functions that use them: importing this
module, like importing kvcloud, needs neither.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..client import KVCloud, PushResult
from ..errors import BatchSizeError, ConfigError, LayoutError, UnsupportedCacheError
from ..namespace import DEFAULT_CHUNK_TOKENS, Namespace
from ._torch import dtype_name, to_numpy

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

__all__ = [
    "BatchSizeError",
    "KVCloudCache",
    "Restored",
    "UnsupportedCacheError",
    "model_namespace",
    "weights_digest",
]

# torch dtypes a cache may hold, by the name kvcloud uses for them (the same names)
_CACHE_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

# Config fields that cannot change the KV computed for given token ids: metadata, token ids
# of special tokens, generation defaults (transformers 4.x kept them in the model config),
# training-only knobs, and fields another namespace field already pins (model type, dtype,
# weights). Every other field goes into the namespace: a field unknown here splits namespaces
# (a spurious miss) instead of letting two incompatible configurations share KV.
_CONFIG_KEYS_IGNORED = frozenset(
    {
        "transformers_version",
        "architectures",
        "model_type",
        "name_or_path",
        "dtype",
        "torch_dtype",
        "use_bfloat16",
        "tie_word_embeddings",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "prefix",
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "dropout",
        "torchscript",
        "tf_legacy_loss",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "return_dict_in_generate",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)


class Restored(NamedTuple):
    """What ``KVCloudCache.restore`` returns; unpacks as ``cache, tokens``."""

    cache: Cache  # a transformers DynamicCache holding the KV of the first ``tokens`` tokens
    tokens: int  # restored prefix length (0: nothing stored; the cache is empty)


# --- namespace -------------------------------------------------------------------------------


def weights_digest(model: torch.nn.Module) -> str:
    """``sha256:<hex>`` over every state_dict entry (name, dtype, shape, raw bytes) in name
    order: two checkpoints share KV only if they hold the same weights bit for bit."""
    import torch

    h = hashlib.sha256(b"kvcloud-weights-v1\x00")
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach()
        if t.device.type == "meta":
            raise ConfigError(
                f"weight {name!r} is on the meta device (not loaded), so it cannot be "
                "digested; pass revision= (a commit or checkpoint id) to KVCloudCache"
            )
        header = json.dumps([name, str(t.dtype), list(t.shape)]).encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        try:
            raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        except (RuntimeError, TypeError) as exc:  # exotic tensor types (e.g. torch.qint8)
            raise ConfigError(
                f"weight {name!r} ({t.dtype}) cannot be read as bytes: {exc}; pass revision= "
                "to KVCloudCache"
            ) from exc
        h.update(memoryview(raw))
    return "sha256:" + h.hexdigest()


def _text_config(model: PreTrainedModel) -> Any:
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedCacheError(
            f"{type(model).__name__} is an encoder-decoder model; kvcloud restores the KV of "
            "decoder-only causal LMs, whose KV follows from the token ids alone"
        )
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if get_text is not None else config
    if text is not config:
        # a composite (e.g. vision-language) model: its KV also depends on images or audio
        # behind placeholder tokens, which the token ids do not identify
        raise UnsupportedCacheError(
            f"{type(model).__name__} is a multimodal model ({config.model_type}); its KV does "
            "not follow from token ids alone, so prefixes cannot be shared by token ids"
        )
    return text


def _kv_relevant_config(config: Any) -> dict[str, Any]:
    return {
        k: v
        for k, v in config.to_dict().items()
        if k not in _CONFIG_KEYS_IGNORED and not k.startswith("_")
    }


def model_namespace(
    model: PreTrainedModel,
    *,
    revision: str | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Namespace:
    """The kvcloud namespace of a transformers causal LM.

    Its ``model`` field is ``config.model_type``; ``revision`` defaults to
    :func:`weights_digest`; ``extra`` is the canonical JSON of every config field that may
    change the KV (RoPE parameters, sliding window, layer types, norms, activation, …),
    tagged with the runtime, so KV computed by another implementation of the same
    architecture is not mixed in.
    """
    config = _text_config(model)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype not in _CACHE_DTYPES:
        raise UnsupportedCacheError(
            f"model dtype {model.dtype} is not a KV cache dtype kvcloud stores"
        )
    extra = json.dumps(
        {"runtime": "transformers", "config": _kv_relevant_config(config)},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return Namespace(
        model=str(config.model_type),
        revision=revision if revision is not None else weights_digest(model),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
        extra=extra,
    )


# --- token ids -------------------------------------------------------------------------------


def _token_ids(ids: Any) -> np.ndarray:
    """One sequence of token ids from a list, numpy array, tensor ([T] or [1, T]), a
    tokenizer's BatchEncoding, or a generate() output (its ``sequences``)."""
    if hasattr(ids, "sequences"):
        ids = ids.sequences
    elif isinstance(ids, Mapping) and "input_ids" in ids:
        ids = ids["input_ids"]
    if hasattr(ids, "detach"):  # a torch tensor, without importing torch to ask
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise BatchSizeError(
                f"got a batch of {arr.shape[0]} sequences; kvcloud restores and saves one "
                "sequence at a time (call once per row, without padding)"
            )
        arr = arr[0]
    if arr.ndim != 1:
        raise LayoutError(f"token ids must be [T] or [1, T], got shape {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise LayoutError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


# --- cache <-> kvcloud arrays ----------------------------------------------------------------


def _layer_tensors(cache: Any) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(keys, values) per layer, each [batch, kv_heads, tokens, head_dim] holding every token
    from position 0, or (None, None) for a layer that holds nothing yet."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return _legacy_layer_tensors(cache)
    from transformers import cache_utils

    dynamic = getattr(cache_utils, "DynamicLayer", None)
    sliding = getattr(cache_utils, "DynamicSlidingWindowLayer", None)
    static = getattr(cache_utils, "StaticLayer", None)
    out: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for i, layer in enumerate(layers):
        # exact types: subclasses (quantized, indexed, linear-attention layers) hold their
        # state differently and would be read wrong
        kind = type(layer)
        if kind in (dynamic, sliding):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not getattr(layer, "is_initialized", keys is not None) or keys is None:
                out.append((None, None))
                continue
            held, total = int(keys.shape[-2]), int(layer.get_seq_length())
            if held != total:
                raise UnsupportedCacheError(
                    f"layer {i} is a sliding-window layer that keeps only the last {held} of "
                    f"{total} tokens; kvcloud stores every token's KV, so this cache cannot "
                    "be saved (save before the window fills, or use a full-attention model)"
                )
            out.append((keys, values))
        elif kind is static:
            n = int(layer.get_seq_length())
            if not n:
                out.append((None, None))
                continue
            out.append((layer.keys[:, :, :n], layer.values[:, :, :n]))
        else:
            raise UnsupportedCacheError(
                f"layer {i} of this {type(cache).__name__} is a {kind.__name__}; kvcloud reads "
                "DynamicLayer, DynamicSlidingWindowLayer (before its window fills) and "
                "StaticLayer, which hold full-precision K and V for every token"
            )
    return out


def _legacy_layer_tensors(cache: Any) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """transformers 4.5x: ``key_cache``/``value_cache`` lists of [batch, heads, seq, dim]."""
    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if keys is None or values is None:
        raise UnsupportedCacheError(
            f"cannot read a {type(cache).__name__}: expected a transformers Cache with "
            "`layers` (transformers 5) or `key_cache`/`value_cache` (transformers 4.5x)"
        )
    seq_len = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else None
    out: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k is None or k.numel() == 0:
            out.append((None, None))
            continue
        # static and sliding-window caches of 4.5x preallocate or roll their tensors, so the
        # tensor length is not the token count there: only a cache whose every layer holds
        # exactly its tokens is read
        if seq_len is not None and int(k.shape[-2]) != seq_len:
            raise UnsupportedCacheError(
                f"layer {i} of this {type(cache).__name__} holds {int(k.shape[-2])} positions "
                f"for {seq_len} tokens (a static or sliding-window cache); kvcloud reads "
                "caches that hold every token's K and V in order (DynamicCache)"
            )
        out.append((k, v))
    return out


def _torch_dtype_name(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


_to_numpy = to_numpy


def _from_numpy(arr: np.ndarray, dtype_name: str) -> torch.Tensor:
    import torch

    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if dtype_name.startswith("float8"):
        return torch.from_numpy(arr.view(np.uint8)).view(getattr(torch, dtype_name))
    return torch.from_numpy(arr)


def _new_dynamic_cache(model: PreTrainedModel) -> Cache:
    from transformers import DynamicCache

    try:
        # built from the config, the cache gets the layer types generate() itself would use
        # (sliding-window layers where the model has them), so a restored run attends
        # exactly as an uninterrupted one
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.5x: no config argument, every layer is full
        return DynamicCache()


def _cache_argument(model: PreTrainedModel) -> str:
    """The generate() keyword for a Cache: ``cache`` since transformers 5.x renamed it,
    ``past_key_values`` before (still accepted, with a deprecation warning)."""
    for fn in (getattr(model, "prepare_inputs_for_generation", None), model.forward):
        if fn is None:
            continue
        try:
            if "cache" in inspect.signature(fn).parameters:
                return "cache"
        except (TypeError, ValueError):
            continue
    return "past_key_values"


# --- the helper ------------------------------------------------------------------------------


class KVCloudCache:
    """Restore and save the KV of one transformers causal LM through a KVCloud client.

    Only full chunks of ``chunk_tokens`` are shared (kvcloud's rule), so a prompt restores the
    longest stored prefix of whole chunks, and ``save`` pushes the whole chunks a cache covers.
    One sequence at a time: batches raise :class:`BatchSizeError`.
    """

    def __init__(
        self,
        kv: KVCloud,
        model: PreTrainedModel,
        *,
        revision: str | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        tenant: str | None = None,
    ) -> None:
        self.kv = kv
        self.model = model
        self.tenant = tenant
        self.namespace = model_namespace(model, revision=revision, chunk_tokens=chunk_tokens)
        self._cache_arg = _cache_argument(model)

    def __repr__(self) -> str:
        ns = self.namespace
        return f"KVCloudCache(model={ns.model!r}, ns={ns.id}, chunk_tokens={ns.chunk_tokens})"

    def new_cache(self) -> Cache:
        """An empty DynamicCache laid out as generate() would build it for this model."""
        return _new_dynamic_cache(self.model)

    def generate_kwargs(self, cache: Cache) -> dict[str, Any]:
        """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever keyword this
        transformers version's generate() takes."""
        return {self._cache_arg: cache}

    def restore(self, input_ids: Any) -> Restored:
        """A cache holding the KV of the longest stored prefix of ``input_ids``.

        At most ``len(input_ids) - 1`` tokens are restored: generate() must run the model on
        at least one prompt token to get the first next-token logits. So a prompt stored
        whole restores all but its last token. Never raises for a store or index outage:
        like any miss, that restores fewer tokens (possibly none).
        """
        toks = _token_ids(input_ids)
        device_map: dict[str, Any] = getattr(self.model, "hf_device_map", None) or {}
        devices = sorted({str(d) for d in device_map.values()})
        if len(devices) > 1:
            # each layer's KV would have to live on that layer's device; all of it on one
            # device would fail inside generate() with a device mismatch
            raise UnsupportedCacheError(
                f"the model is split across devices {devices}; restore supports a model on "
                "one device"
            )
        cache = self.new_cache()
        ns = self.namespace
        limit = len(toks) - 1
        if limit < ns.chunk_tokens:
            return Restored(cache, 0)
        match = self.kv.lookup(ns, toks, self.tenant)
        if not match:
            return Restored(cache, 0)
        arr = self.kv.pull(match)  # shorter than the match if an object was bad or gone
        n = min(int(arr.shape[2]), limit)
        if n:
            self._fill(cache, arr[:, :, :n])
        return Restored(cache, n)

    def _fill(self, cache: Cache, arr: np.ndarray) -> None:
        device = getattr(self.model, "device", None)
        kv = _from_numpy(arr, self.namespace.dtype)  # [layers, 2, T, kv_heads, head_dim]
        if device is not None:
            kv = kv.to(device)
        for layer in range(kv.shape[0]):
            # kvcloud keeps tokens before heads; transformers wants [batch, heads, T, dim]
            keys = kv[layer, 0].transpose(0, 1).unsqueeze(0)
            values = kv[layer, 1].transpose(0, 1).unsqueeze(0)
            cache.update(keys.contiguous(), values.contiguous(), layer)

    def save(self, input_ids: Any, cache: Cache | None = None) -> PushResult:
        """Push the full chunks of KV that ``cache`` holds for ``input_ids``.

        ``input_ids`` are the tokens the cache was computed from: the prompt, or generate()'s
        output sequence (whose last token has no KV yet; it is simply not covered). A partial
        tail chunk is not pushed. With ``cache`` omitted, ``input_ids`` must be a generate()
        output that carries its cache (``return_dict_in_generate=True``). Chunks already
        stored are skipped. Raises PushError (a KVCloudError) if some chunk could not be
        stored, BatchSizeError for a batch, UnsupportedCacheError for a cache whose layers
        do not hold every token (sliding window past its size, quantized, …), TypeError
        when no cache is given or found.
        """
        if cache is None:
            # explicit None checks: a Cache defines __len__, so an empty one is falsy
            for name in ("cache", "past_key_values"):
                cache = getattr(input_ids, name, None)
                if cache is not None:
                    break
            else:
                raise TypeError(
                    "save() needs the cache: pass it, or a generate() output made with "
                    "return_dict_in_generate=True"
                )
        toks = _token_ids(input_ids)
        ns = self.namespace
        tensors = _layer_tensors(cache)
        if not tensors:  # a lazily built DynamicCache that never ran: nothing to store
            return PushResult()
        held = self._check_layout(tensors)
        n = min(held, len(toks)) // ns.chunk_tokens * ns.chunk_tokens
        if n == 0:
            return PushResult()
        arr = self._to_array(tensors, n)
        return self.kv.push(ns, toks[:n], arr, self.tenant)

    def _check_layout(self, tensors: Sequence[tuple[Any, Any]]) -> int:
        """Validate the cache against the namespace; return the tokens every layer holds."""
        ns = self.namespace
        if len(tensors) != ns.num_layers:
            raise LayoutError(f"the cache has {len(tensors)} layers, the model {ns.num_layers}")
        lengths: set[int] = set()
        for i, (k, v) in enumerate(tensors):
            if k is None or v is None:
                lengths.add(0)
                continue
            if k.dim() != 4 or k.shape != v.shape:
                raise UnsupportedCacheError(
                    f"layer {i}: keys {list(k.shape)} and values {list(v.shape)} are not both "
                    "[batch, kv_heads, tokens, head_dim] of one shape"
                )
            if k.shape[0] != 1:
                raise BatchSizeError(
                    f"the cache holds a batch of {k.shape[0]} sequences; kvcloud saves one "
                    "sequence at a time"
                )
            if (int(k.shape[1]), int(k.shape[3])) != (ns.num_kv_heads, ns.head_dim):
                raise LayoutError(
                    f"layer {i} holds {k.shape[1]} heads of {k.shape[3]}; the model's "
                    f"namespace says {ns.num_kv_heads} of {ns.head_dim}"
                )
            if _torch_dtype_name(k) != ns.dtype or _torch_dtype_name(v) != ns.dtype:
                raise LayoutError(f"layer {i} holds {k.dtype}; the namespace dtype is {ns.dtype}")
            lengths.add(int(k.shape[2]))
        if len(lengths) > 1:
            raise UnsupportedCacheError(
                f"the cache's layers hold different token counts {sorted(lengths)}; kvcloud "
                "stores the same tokens for every layer"
            )
        return lengths.pop() if lengths else 0

    def _to_array(self, tensors: Sequence[tuple[Any, Any]], n: int) -> np.ndarray:
        import torch

        # [layers, 2, kv_heads, n, head_dim] -> kvcloud's [layers, 2, n, kv_heads, head_dim]
        stacked = torch.stack([torch.stack((k[0, :, :n], v[0, :, :n])) for k, v in tensors])
        return _to_numpy(stacked.transpose(2, 3).contiguous().cpu())
