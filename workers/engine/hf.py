"""Serve a local Hugging Face checkpoint: ``kvcloud-worker serve --model-path DIR``.

Reads what ``save_pretrained`` writes for Llama-, Qwen2- and Mistral-family models:
``config.json`` (both the transformers 5 ``rope_parameters`` and the older ``rope_theta`` /
``rope_scaling`` spellings), ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (bf16, fp16 or fp32), ``tokenizer.json``, and the chat
template from ``chat_template.jinja`` or ``tokenizer_config.json``. Never touches the network:
a missing file is a :class:`CheckpointError` naming it.

The KV namespace carries a SHA-256 digest of the weight files, so two checkpoints never share
KV even when their configs are identical (a fine-tune of the same base, say).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcloud.errors import ConfigError

from .model import ROPE_TYPES, ModelConfig

log = logging.getLogger("kvcloud.worker.hf")

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ConfigError):
    """A checkpoint directory that cannot be served: missing files, an unsupported model
    type or RoPE variant, tensors that do not fit the config."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _rope(cfg: Mapping[str, Any]) -> tuple[float, str, dict[str, float]]:
    """(theta, type, parameters) from either spelling of the RoPE settings."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        params = dict(rp)
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    rope_type = str(params.pop("rope_type", None) or params.pop("type", None) or "default")
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"RoPE type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
            "'dynamic' NTK scaling changes every position's rotation with the sequence length, "
            "so its KV cannot be stored and reused"
        )
    numeric = {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
    return float(theta), rope_type, numeric


def _sliding_windows(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple:
    window = cfg.get("sliding_window")
    if not window:
        return ()
    window = int(window)
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        per_layer = tuple(window if t == "sliding_attention" else None for t in types)
    elif model_type == "qwen2":
        # transformers 4.x Qwen2: layers from max_window_layers on use the window, if enabled
        if not cfg.get("use_sliding_window"):
            return ()
        first = int(cfg.get("max_window_layers", layers))
        per_layer = tuple(window if i >= first else None for i in range(layers))
    else:  # Mistral: every layer
        per_layer = (window,) * layers
    return per_layer if any(w is not None for w in per_layer) else ()


@dataclass(frozen=True)
class Checkpoint:
    """What config.json (read once) and generation_config.json say about a checkpoint."""

    path: Path
    cfg: ModelConfig
    model_type: str
    saved_dtype: str  # float32 | bfloat16 | float16: what the weights were written in
    eos_ids: tuple[int, ...]  # from generation_config.json and config.json


def inspect_checkpoint(path: Path) -> Checkpoint:
    if not path.is_dir():
        raise CheckpointError(f"--model-path {path} is not a directory")
    raw = _read_json(path / "config.json")
    model_type = str(raw.get("model_type", ""))
    saved = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    eos = _eos_ids(raw)
    if (path / "generation_config.json").exists():
        eos = _eos_ids(_read_json(path / "generation_config.json")) + eos
    return Checkpoint(
        path=path,
        cfg=_model_config(raw, path, model_type),
        model_type=model_type,
        saved_dtype=saved if saved in ("float32", "bfloat16", "float16") else "float32",
        eos_ids=tuple(eos),
    )


def _eos_ids(raw: Mapping[str, Any]) -> list[int]:
    value = raw.get("eos_token_id")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _model_config(cfg: Mapping[str, Any], path: Path, model_type: str) -> ModelConfig:
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path / 'config.json'}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    try:
        d_model = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        theta, rope_type, rope_params = _rope(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {cfg['hidden_act']!r}: only silu is supported")
        if cfg.get("mlp_bias"):
            raise CheckpointError("mlp_bias=true is not supported")
        attn_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
        return ModelConfig(
            name=path.name or model_type,
            vocab_size=int(cfg["vocab_size"]),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or d_model // n_heads),
            ffn_dim=int(cfg["intermediate_size"]),
            max_context=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=attn_bias,
            rope_type=rope_type,
            rope_params=tuple(sorted(rope_params.items())),
            sliding_windows=_sliding_windows(cfg, model_type, n_layers),
        )
    except CheckpointError:
        raise
    except KeyError as exc:
        raise CheckpointError(f"{path / 'config.json'} lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint, in a stable order."""
    index = path / _INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted({str(v) for v in weight_map.values()})
        if any("/" in f or f.startswith(".") for f in files):
            raise CheckpointError(f"{index}: shard names must be plain file names")
        out = [path / f for f in files]
    elif (path / _SINGLE).exists():
        out = [path / _SINGLE]
    else:
        raise CheckpointError(
            f"{path}: no {_SINGLE} or {_INDEX} (only safetensors checkpoints are served; "
            "convert a .bin checkpoint with transformers' save_pretrained)"
        )
    for f in out:
        if not f.is_file():
            raise CheckpointError(f"shard {f} listed in {_INDEX} is missing")
    return out


def weights_digest(files: Iterable[Path]) -> str:
    """SHA-256 over every weight file (names and bytes), hex."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def _our_name(hf: str) -> str | None:
    """Map a Hugging Face tensor name to ours; None for buffers we recompute (inv_freq)."""
    if hf.endswith("rotary_emb.inv_freq"):
        return None
    if hf == "model.embed_tokens.weight":
        return "embed.weight"
    if hf == "model.norm.weight":
        return "norm.weight"
    if hf == "lm_head.weight":
        return "lm_head.weight"
    if hf.startswith("model.layers."):
        rest = hf.removeprefix("model.layers.")
        idx, _, sub = rest.partition(".")
        sub = (
            sub.replace("input_layernorm.", "attn_norm.")
            .replace("post_attention_layernorm.", "mlp_norm.")
            .replace("self_attn.", "")
            .replace("mlp.", "")
        )
        return f"layers.{idx}.{sub}"
    return f"?{hf}"  # unknown: reported by the model as unexpected


def iter_weights(files: Sequence[Path], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every tensor, one shard in memory at a time."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: not a readable safetensors file ({exc})") from None
        for name in list(tensors):
            t = tensors.pop(name)
            ours = _our_name(name)
            if ours is None:
                continue
            if ours == "lm_head.weight" and cfg.tie_embeddings:
                continue  # some tied checkpoints also save the (identical) head
            yield ours, t


def load_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> tuple[Any, str]:
    """(Decoder with the checkpoint's weights, weights digest)."""
    from .model import Decoder

    cfg, path = ckpt.cfg, ckpt.path
    files = weight_files(path)
    t0 = time.perf_counter()
    digest = weights_digest(files)
    t1 = time.perf_counter()
    try:
        model = Decoder(cfg, device, weights=iter_weights(files, cfg), dtype=dtype)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    log.info(
        "loaded %s (%s, %d layers) from %s: digest %.1f s, load %.1f s",
        cfg.name,
        digest[:12],
        cfg.n_layers,
        path,
        t1 - t0,
        time.perf_counter() - t1,
    )
    return model, digest


# --- tokenizer and chat template -----------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, plus the checkpoint's chat
    template rendered the way transformers renders it (sandboxed Jinja, trimmed blocks)."""

    path: Path
    vocab_size: int
    extra_eos: Sequence[int] = ()

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer

        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing (only fast tokenizers are supported: save one with "
                "transformers' AutoTokenizer(...).save_pretrained)"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library raises plain Exception
            raise CheckpointError(f"{file}: {exc}") from None
        tc_path = self.path / "tokenizer_config.json"
        tc = _read_json(tc_path) if tc_path.exists() else {}
        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        # BOS comes from the tokenizer's post-processor where the checkpoint adds one
        # (Llama); Qwen2 adds none. Ask the tokenizer instead of guessing from names.
        probe_plain = self._tok.encode("a", add_special_tokens=False).ids
        probe_special = self._tok.encode("a", add_special_tokens=True).ids
        self.bos_id: int | None = probe_special[0] if probe_special[1:] == probe_plain else None
        eos = set(self.extra_eos)
        if self.eos_token is not None and (i := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(i)
        self.eos_ids: frozenset[int] = frozenset(eos)
        self.chat_template = self._find_template(tc)
        # compiled at start: a template that does not parse is the checkpoint's fault and
        # should stop the worker, not turn every chat request into a 500
        self._compiled: Any = None
        if self.chat_template is not None:
            from jinja2 import TemplateError

            try:
                self._compiled = _compile_template(self.chat_template)
            except TemplateError as exc:
                msg = f"{self.path}: the chat template does not parse ({exc})"
                raise CheckpointError(msg) from None

    def _find_template(self, tc: Mapping[str, Any]) -> str | None:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: the default one serves chat
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    # the engine adds BOS to a text prompt; a chat template writes its own
    chat_adds_bos = False

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            raise ValueError(
                f"the checkpoint at {self.path} has no chat template; use /v1/completions"
            )
        from jinja2 import TemplateError

        try:
            return str(
                self._compiled.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                    tools=None,
                )
            )
        except (_TemplateRaised, TemplateError) as exc:
            # raise_exception(), or the sandbox refusing what the template (given these
            # messages) tried: the request's problem, reported as a 400
            raise ValueError(f"chat template: {exc}") from None


class _TemplateRaised(Exception):
    """raise_exception() called by a chat template (e.g. roles out of order)."""


def _compile_template(source: str) -> Any:
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise _TemplateRaised(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        # transformers' filter: no HTML escaping, unlike Jinja's built-in
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def namespace_extra(cfg: ModelConfig) -> str:
    """Everything besides weights and shape that changes the KV bytes."""
    parts = [f"rope_theta={cfg.rope_theta}", f"rope={cfg.rope_type}"]
    parts += [f"{k}={v}" for k, v in cfg.rope_params]
    if cfg.sliding_windows:
        parts.append("windows=" + ",".join(str(w or 0) for w in cfg.sliding_windows))
    if cfg.attn_bias:
        parts.append("attn_bias")
    return ";".join(parts)
