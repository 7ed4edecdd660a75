"""Sizing a vLLM fleet that uses kvcloud (``kvcloud size``): from a model's ``config.json`` and
the fleet's load, the KV per token and per object, the S3 requests and bandwidth, the Redis
memory, the host memory of each vLLM process and the store's bytes over the index TTL.

Each figure follows what the vLLM connector does rather than a formula of its own: the
namespace geometry it derives (``integrations/vllm/keys.py``), the objects it stores per
chunk and the ranks that read them (``shard.py``), each object's size from the segment
encoder's own header code (``segment.encoded_size``), the buffers it allocates
(``config.py``, ``uploader.py``, ``worker.py``, ``staging.py``), and the Redis memory per
chunk measured by ``scripts/bench/bench_index_parts.py``. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..indexes.base import DEFAULT_TTL_SECONDS
from ..integrations.vllm.config import VLLMConnectorConfig
from ..integrations.vllm.shard import Shard, shard_of

# the uploader pushes up to this many chunks at once, taken off its queue (uploader._BATCH)
from ..integrations.vllm.uploader import _BATCH as UPLOAD_BATCH
from ..namespace import DEFAULT_CHUNK_TOKENS, Namespace, dtype_info
from ..segment import SEGMENT_VERSION, encoded_size

# where a multimodal checkpoint keeps its language model's config (vLLM: get_hf_text_config)
_TEXT_SECTIONS = ("text_config", "llm_config", "language_config")
_MODEL_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}
# vLLM's --kv-cache-dtype → the namespace dtype (keys.kv_dtype_name, with NVIDIA's e4m3)
KV_DTYPES = {
    "auto": "",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

# Redis memory per chunk (INFO used_memory delta ÷ chunks) with kvcloud's default expiry
# layout for the server (field TTL on Redis 8.2.3, value expiry on Redis 7.0.15), by the
# parts a chunk is stored in: 1 entry at TP 1; at TP > 1 one record per part plus the
# chunk's entry naming every part, whose value is too long for Redis's compact listpack.
# Measured by scripts/bench/bench_index_parts.py (docs/bench/index_parts.json, 51,200 chunks in
# 1,024 buckets); docs/OPERATIONS.md has the table.
REDIS_BYTES_PER_CHUNK: dict[str, dict[int, float]] = {
    "redis8": {1: 126.3, 2: 717.1, 3: 984.8, 4: 1234.7, 6: 1872.4, 8: 2297.1, 16: 4481.4},
    "redis7": {1: 115.8, 2: 719.0, 3: 995.8, 4: 1315.1, 6: 1905.5, 8: 2353.0, 16: 4610.8},
}
REDIS_SERVERS = {"redis8": "Redis 8.2.3, field TTL", "redis7": "Redis 7.0.15, value expiry"}


@dataclass(frozen=True)
class ModelKV:
    """What of a model decides the KV the connector stores: the namespace's geometry."""

    model_type: str
    num_layers: int
    num_kv_heads: int  # as stored: 1 for MLA
    head_dim: int  # as stored: half the latent row for MLA
    dtype: str  # the model's compute dtype, as vLLM resolves it
    mla: tuple[int, int] | None = None  # (kv_lora_rank, qk_rope_head_dim)
    notes: tuple[str, ...] = ()

    def kv_dtype(self, kv: str = "auto") -> str:
        """The namespace dtype of vLLM's ``--kv-cache-dtype kv`` (``auto``: the model's)."""
        if kv not in KV_DTYPES:
            raise ConfigError(f"unknown KV dtype {kv!r}; known: {', '.join(KV_DTYPES)}")
        name = KV_DTYPES[kv] or self.dtype
        if name.startswith("float8") and self.mla is not None:
            # the connector refuses it at start (keys.kv_dtype_name)
            raise ConfigError(
                "an MLA model with an fp8 KV cache: the kvcloud connector does not store it"
            )
        return name

    def namespace(self, kv_dtype: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Namespace:
        """A namespace of this geometry: what sizes an object (ids and revisions do not)."""
        return Namespace(
            model=f"vllm/{self.model_type}",
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=kv_dtype,
            chunk_tokens=chunk_tokens,
        )


def read_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face ``config.json``, or the one in a model directory, as a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no model config at {p}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config {p}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{p} is not a model config (a JSON object)")
    return config


def _positive_int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} has no positive integer {key!r} (got {value!r})")
    return value


def model_dtype(config: dict[str, Any], override: str | None = None) -> tuple[str, str | None]:
    """The model's compute dtype as vLLM's ``--dtype`` resolves it, and a note when vLLM
    changes the config's. ``auto`` on a GPU with bfloat16 downcasts a float32 (or
    unspecified, which transformers reads as float32) config to bfloat16
    (vllm/config/model.py ``_resolve_auto_dtype``)."""
    if override and override != "auto":
        if override not in _MODEL_DTYPES:
            raise ConfigError(
                f"unknown dtype {override!r}; known: auto, bfloat16, float16, float32"
            )
        return _MODEL_DTYPES[override], None
    raw = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = _MODEL_DTYPES.get(str(raw).removeprefix("torch."))
    if name is None:
        raise ConfigError(f"the model config's dtype {raw!r} is not bfloat16, float16 or float32")
    if name == "float32":
        return "bfloat16", "a float32 config runs in bfloat16 under vLLM's --dtype auto on a GPU"
    return name, None


def model_kv(config: dict[str, Any], dtype: str | None = None) -> ModelKV:
    """The stored KV geometry of a Hugging Face config, as ``keys.vllm_namespace`` derives it
    from vLLM's model config: every layer (a chunk object holds them all), the model's KV
    heads whatever the TP size, ``head_dim`` or ``hidden_size ÷ num_attention_heads``. An MLA
    model (``kv_lora_rank``, DeepSeek-V2/V3 style) caches one latent row of
    ``kv_lora_rank + qk_rope_head_dim`` per token and layer, stored as one head of half its
    width (``keys.mla_dims``). A multimodal config's language model is its ``text_config``."""
    notes: list[str] = []
    text, where = config, "the model config"
    section = next((k for k in _TEXT_SECTIONS if isinstance(config.get(k), dict)), None)
    if section is not None:
        text, where = config[section], f"the model config's {section}"
        notes.append(f"the language model's {section}")
    layers = _positive_int(text, "num_hidden_layers", where)
    heads = _positive_int(text, "num_attention_heads", where)
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or _positive_int(text, "hidden_size", where) // heads
    name, why = model_dtype(
        {**config, **{k: text[k] for k in ("dtype", "torch_dtype") if text.get(k)}}, dtype
    )
    if why:
        notes.append(why)
    mla = None
    if text.get("kv_lora_rank"):
        lora, rope = int(text["kv_lora_rank"]), int(text.get("qk_rope_head_dim") or 0)
        if (lora + rope) % 2:
            raise ConfigError(
                f"an MLA latent of {lora} + {rope} values per token: kvcloud stores it as two "
                "halves and cannot split an odd width"
            )
        mla, kv_heads, head_dim = (lora, rope), 1, (lora + rope) // 2
        notes.append("MLA: one latent row per token and layer, stored once for every TP rank")
    types = text.get("layer_types")
    if isinstance(types, list) and any("sliding" in str(t) for t in types):
        sliding = sum("sliding" in str(t) for t in types)
        notes.append(f"{sliding} of {len(types)} layers slide; a chunk object holds every layer")
    elif text.get("sliding_window") and text.get("use_sliding_window", True):
        notes.append("sliding-window attention; a chunk object holds every layer")
    if text.get("num_nextn_predict_layers"):
        notes.append("MTP layers not counted (stored only with speculative decoding on)")
    return ModelKV(
        model_type=str(text.get("model_type") or config.get("model_type") or "unknown"),
        num_layers=layers,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        dtype=name,
        mla=mla,
        notes=tuple(notes),
    )


# -- the formulas ---------------------------------------------------------------------------


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The usual formula: layers × kv_heads × head_dim × bytes per element × 2 (K and V).
    For MLA the stored head is half the latent row, so × 2 gives the row: layers ×
    (kv_lora_rank + qk_rope_head_dim) × bytes."""
    return num_layers * num_kv_heads * head_dim * itemsize * 2


@dataclass(frozen=True)
class ChunkObjects:
    """How a vLLM of one TP size stores and reads one chunk (shard.py): the objects, the
    ranks that write them, and what every rank pulls to restore it."""

    heads: tuple[tuple[int, int] | None, ...]  # each object's KV heads; None: all of them
    object_bytes: tuple[int, ...]  # each object's size (segment.encoded_size)
    rank_chunk_bytes: tuple[int, ...]  # per rank: its KV of one chunk (one buffer slot)
    rank_writes: tuple[bool, ...]  # per rank: it stores parts (the first of its replicas)
    gets: int  # objects the server's ranks GET to restore the chunk, summed
    get_bytes: int  # their bytes, summed

    @property
    def objects(self) -> int:
        return len(self.heads)

    @property
    def bytes(self) -> int:
        return sum(self.object_bytes)


def _shards(tp: int, num_kv_heads: int, head_parts: int) -> list[Shard]:
    """Every rank's shard, storing in ``head_parts`` head ranges as the connector sets it up
    at start (``connector._stored_in``); a ConfigError where vLLM cannot split the KV heads
    over ``tp`` ranks or the connector refuses ``head_parts``."""
    try:
        return [
            shard_of(r, tp, num_kv_heads).with_head_parts(head_parts, num_kv_heads)
            for r in range(tp)
        ]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _overlaps(a: tuple[int, int], b: tuple[int, int] | None) -> bool:
    return b is None or (a[0] < b[1] and b[0] < a[1])


def chunk_objects(ns: Namespace, tp: int = 1, head_parts: int = 1) -> ChunkObjects:
    """One object per chunk at TP 1 (and for MLA at any TP: one head, stored by rank 0);
    at TP > 1 one part per distinct head range, written by the first rank of each replica
    group (``Shard.write_ranges``), and each rank reads every part overlapping its heads."""
    shards = _shards(tp, ns.num_kv_heads, head_parts)
    stored: list[tuple[int, int] | None] = []
    for s in shards:
        if s.writer:
            stored += [r for r in s.write_ranges() if r not in stored]
    sizes = tuple(encoded_size(ns, heads=r, version=SEGMENT_VERSION) for r in stored)
    gets = get_bytes = 0
    for s in shards:
        for r, size in zip(stored, sizes, strict=True):
            if _overlaps((s.lo, s.hi), r):
                gets += 1
                get_bytes += size
    per_head = ns.num_layers * 2 * ns.chunk_tokens * ns.head_dim * ns.dtype_info.itemsize
    return ChunkObjects(
        heads=tuple(stored),
        object_bytes=sizes,
        rank_chunk_bytes=tuple(per_head * s.num_heads for s in shards),
        rank_writes=tuple(s.writer for s in shards),
        gets=gets,
        get_bytes=get_bytes,
    )


def redis_entries_per_chunk(objects: int) -> int:
    """Index entries one chunk makes (client/parts.py): its entry, plus at TP > 1 one part
    record per part (``offer_part``), which lives one TTL from its write."""
    return 1 if objects == 1 else objects + 1


def redis_bytes_per_chunk(objects: int, server: str = "redis8") -> float:
    """Measured Redis memory per chunk stored in ``objects`` parts (REDIS_BYTES_PER_CHUNK);
    a part count not measured is interpolated linearly between its measured neighbours
    (beyond the last, along the last two: each part adds a record and a key)."""
    table = REDIS_BYTES_PER_CHUNK.get(server)
    if table is None:
        raise ConfigError(f"unknown Redis server {server!r}; known: {', '.join(REDIS_SERVERS)}")
    if objects in table:
        return table[objects]
    counts = sorted(table)
    lo = max((c for c in counts if c < objects), default=counts[0])
    hi = min((c for c in counts if c > objects), default=None)
    if hi is None:
        lo, hi = counts[-2], counts[-1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return table[lo] + slope * (objects - lo)


def upload_buffer_bytes(rank_chunk_bytes: int, upload_queue: int) -> int:
    """Host buffers of a writing rank's saves at most: one chunk buffer (``worker._BufferPool``,
    the rank's heads of every layer) per chunk in the upload queue (``upload_queue``) plus
    those of the push under way, taken off the queue (up to ``uploader._BATCH``)."""
    return (upload_queue + UPLOAD_BATCH) * rank_chunk_bytes


def put_body_bytes(object_bytes: int, puts_at_once: int) -> int:
    """The S3 store joins an object's header and KV into one body per PUT
    (``stores.base.join_parts``): a copy of each object in flight."""
    return puts_at_once * object_bytes


def staging_bytes(rank_chunk_bytes: int, staging_mib: int) -> int:
    """A rank's restore staging ring (staging.py): ``staging_mib`` of whole chunk slots, at
    least one, allocated (pinned on a GPU) by its first restore."""
    slots = max(1, (staging_mib << 20) // rank_chunk_bytes)
    return slots * rank_chunk_bytes


def chunks_per_second(requests_per_s: float, tokens_per_request: float, chunk_tokens: int) -> float:
    """Chunks a second: tokens ÷ chunk size. An average: the connector saves and restores
    full chunks only, so with prompts of varying length it is up to one chunk per request
    high."""
    return requests_per_s * tokens_per_request / chunk_tokens


# -- the whole sizing -------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetLoad:
    """A fleet of identical vLLM servers (``pods``, each one TP group) and its load."""

    requests_per_s: float
    prompt_tokens: int
    hit_rate: float = 0.0  # share of prompt tokens restored from kvcloud
    saved_tokens: float | None = None  # new tokens saved per request; None: derived
    answer_tokens: int = 0  # saved with the prompt's new tokens (save_decode, on by default)
    tp: int = 1
    pods: int = 1
    kv_dtype: str = "auto"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    head_parts: int = 1
    ttl_seconds: int = DEFAULT_TTL_SECONDS
    conditional_put: bool = True  # the S3 server honours If-None-Match (else a HEAD first)
    redis: str = "redis8"
    connector: VLLMConnectorConfig = field(default_factory=VLLMConnectorConfig)

    def check(self) -> None:
        if not self.requests_per_s > 0:
            raise ConfigError(f"requests per second must be > 0, got {self.requests_per_s}")
        if self.prompt_tokens <= 0:
            raise ConfigError(f"prompt tokens must be > 0, got {self.prompt_tokens}")
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ConfigError(f"the hit rate is a share of 0 to 1, got {self.hit_rate}")
        if self.saved_tokens is not None and self.saved_tokens < 0:
            raise ConfigError(f"saved tokens must be >= 0, got {self.saved_tokens}")
        for name in ("tp", "pods", "chunk_tokens", "head_parts", "ttl_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.answer_tokens < 0:
            raise ConfigError(f"answer tokens must be >= 0, got {self.answer_tokens}")


def _rates(count: float, nbytes: float, pods: int) -> dict[str, float]:
    return {
        "fleet": count,
        "per_pod": count / pods,
        "bytes": nbytes,
        "bytes_per_pod": nbytes / pods,
    }


def size_fleet(model: ModelKV, load: FleetLoad) -> dict[str, Any]:
    """Every figure of ``kvcloud size``, as a JSON-ready dict (rates per second; bytes)."""
    load.check()
    kv_dtype = model.kv_dtype(load.kv_dtype)
    ns = model.namespace(kv_dtype, load.chunk_tokens)
    per_token = kv_bytes_per_token(
        model.num_layers, model.num_kv_heads, model.head_dim, dtype_info(kv_dtype).itemsize
    )
    assert per_token == ns.bytes_per_token  # the usual formula is the namespace's
    objs = chunk_objects(ns, load.tp, load.head_parts)
    restored = load.prompt_tokens * load.hit_rate
    saved = (
        load.saved_tokens
        if load.saved_tokens is not None
        else load.prompt_tokens - restored + load.answer_tokens
    )
    pods, c = load.pods, load.chunk_tokens
    saved_chunks = chunks_per_second(load.requests_per_s, saved, c)
    restored_chunks = chunks_per_second(load.requests_per_s, restored, c)
    puts = saved_chunks * objs.objects
    gets = restored_chunks * objs.gets
    heads = 0.0 if load.conditional_put else puts
    put_bytes, get_bytes = saved_chunks * objs.bytes, restored_chunks * objs.get_bytes
    entries = redis_entries_per_chunk(objs.objects)
    redis_chunk = redis_bytes_per_chunk(objs.objects, load.redis)
    # every saved chunk is new to the index (chunks it holds are not saved again); a
    # restored entry's TTL slides, so it lives longer than one TTL: a floor
    chunks_in_ttl = saved_chunks * load.ttl_seconds
    cfg = load.connector
    # whole chunks go out up to max_connections at once (push_chunks over the store's pool,
    # a batch at a time); parts one at a time per rank (Uploader._store_parts)
    at_once = min(cfg.max_connections, UPLOAD_BATCH) if objs.objects == 1 else 1
    ranks = []
    for rank, (chunk, writes) in enumerate(
        zip(objs.rank_chunk_bytes, objs.rank_writes, strict=True)
    ):
        upload = upload_buffer_bytes(chunk, cfg.upload_queue) if writes else 0
        body = put_body_bytes(max(objs.object_bytes), at_once) if writes else 0
        staging = staging_bytes(chunk, cfg.staging_mib)
        ranks.append(
            {
                "rank": rank,
                "chunk_bytes": chunk,
                "writes": writes,
                "upload_buffers": upload,
                "put_bodies": body,
                "staging": staging,
                "total": upload + body + staging,
            }
        )
    return {
        "model": {
            "model_type": model.model_type,
            "num_layers": model.num_layers,
            "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
            "dtype": model.dtype,
            "kv_dtype": kv_dtype,
            "mla": list(model.mla) if model.mla else None,
            "notes": list(model.notes),
        },
        "load": {
            "requests_per_s": load.requests_per_s,
            "prompt_tokens": load.prompt_tokens,
            "hit_rate": load.hit_rate,
            "restored_tokens": restored,
            "saved_tokens": saved,
            "tp": load.tp,
            "pods": pods,
            "chunk_tokens": c,
            "head_parts": load.head_parts,
            "ttl_seconds": load.ttl_seconds,
        },
        "kv": {"bytes_per_token": per_token, "chunk_bytes": per_token * c},
        "objects": {
            "per_chunk": objs.objects,
            "bytes": list(objs.object_bytes),
            "overhead": objs.bytes - per_token * c,
            "bytes_per_chunk": objs.bytes,
            "gets_per_restored_chunk": objs.gets,
            "get_bytes_per_restored_chunk": objs.get_bytes,
        },
        "s3": {
            "chunks_saved_per_s": saved_chunks,
            "chunks_restored_per_s": restored_chunks,
            "put": _rates(puts, put_bytes, pods),
            "get": _rates(gets, get_bytes, pods),
            "head": _rates(heads, 0.0, pods),
            "conditional_put": load.conditional_put,
        },
        "redis": {
            "server": REDIS_SERVERS[load.redis],
            "entries_per_chunk": entries,
            "bytes_per_chunk": redis_chunk,
            "bytes_per_million_chunks": redis_chunk * 1e6,
            "chunks_in_ttl": chunks_in_ttl,
            "entries_in_ttl": chunks_in_ttl * entries,
            "bytes_in_ttl": chunks_in_ttl * redis_chunk,
        },
        "store": {"bytes_per_s": put_bytes, "bytes_in_ttl": chunks_in_ttl * objs.bytes},
        "host_memory": {
            "upload_queue": cfg.upload_queue,
            "staging_mib": cfg.staging_mib,
            "ranks": ranks,
            "per_pod": sum(r["total"] for r in ranks),
        },
    }


__all__ = [
    "ChunkObjects",
    "FleetLoad",
    "ModelKV",
    "chunk_objects",
    "kv_bytes_per_token",
    "model_kv",
    "read_config",
    "size_fleet",
]
