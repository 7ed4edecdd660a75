"""Worker configuration. Each field names the environment variable that sets it; CLI flags
override the environment, which overrides the defaults."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from kvcloud.config import env_values

from .http.auth import ApiKeys, load_api_keys

WRITE_POLICIES = ("write-back", "write-through", "off")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class WorkerOptions:
    model: str = field(default="small", metadata={"env": "KVCLOUD_WORKER_MODEL"})
    """Model preset: tiny (tests) or small (demo, benchmarks)."""

    seed: int = field(default=0, metadata={"env": "KVCLOUD_WORKER_SEED"})
    """Seed of the preset's random weights; workers must agree to share KV."""

    model_path: str | None = field(default=None, metadata={"env": "KVCLOUD_WORKER_MODEL_PATH"})
    """Local Hugging Face checkpoint directory (Llama, Qwen2, Mistral); replaces the preset."""

    model_dtype: str = field(default="auto", metadata={"env": "KVCLOUD_MODEL_DTYPE"})
    """Weights/compute dtype for --model-path: auto (float32 on CPU, the checkpoint's on
    CUDA), float32, bfloat16 or float16."""

    store: str | None = field(default=None, metadata={"env": "KVCLOUD_STORE"})
    """kvcloud object store URL; unset or "none" runs without a store (local cache only)."""

    index: str | None = field(default=None, metadata={"env": "KVCLOUD_INDEX"})
    """kvcloud index URL; needed whenever a store is set."""

    secret: str | None = field(default=None, repr=False, metadata={"env": "KVCLOUD_SECRET"})
    """Master secret from which tenant fingerprint keys are derived."""

    worker_id: str = field(
        default_factory=_default_worker_id, metadata={"env": "KVCLOUD_WORKER_ID"}
    )
    """Name in logs, metrics and /healthz."""

    cache_pages: int = field(default=64, metadata={"env": "KVCLOUD_CACHE_PAGES"})
    """KV pages in memory; one page holds chunk_tokens tokens of every layer."""

    write_policy: str = field(default="write-back", metadata={"env": "KVCLOUD_WRITE_POLICY"})
    """write-back: push pages when evicted; write-through: when full; off: never."""

    chunk_tokens: int = field(default=256, metadata={"env": "KVCLOUD_CHUNK_TOKENS"})
    """Tokens per page and per stored segment."""

    kv_dtype: str = field(default="float16", metadata={"env": "KVCLOUD_KV_DTYPE"})
    """Cache dtype: float16, bfloat16 or float32. What is stored is exactly the page."""

    kv_codec: str = field(default="lossless", metadata={"env": "KVCLOUD_KV_CODEC"})
    """lossless (stored KV restores bit for bit) or int8 (1 byte per element plus a scale per
    token and head: about half the bytes of 16-bit KV, restored approximately). int8 is its
    own namespace: its KV is never served to a lossless worker, nor the reverse. Sessions
    that must continue bit-identically need lossless."""

    device: str = field(default="auto", metadata={"env": "KVCLOUD_DEVICE"})
    """cpu, cuda, or auto (cuda when available)."""

    threads: int = field(default=0, metadata={"env": "KVCLOUD_THREADS"})
    """torch intra-op threads; 0 keeps torch's default."""

    upload_queue: int = field(default=64, metadata={"env": "KVCLOUD_UPLOAD_QUEUE"})
    """Pages waiting for the background uploader; beyond it uploads are dropped (counted)."""

    max_sessions: int = field(default=256, metadata={"env": "KVCLOUD_MAX_SESSIONS"})
    """Sessions held in memory; the least recently used one beyond it is flushed and let go."""

    session_write_through: bool = field(
        default=True, metadata={"env": "KVCLOUD_SESSION_WRITE_THROUGH"}
    )
    """Write a session's record (history, conversation) to the index at the end of every turn,
    before the answer completes, and check it at the start of every turn, so consecutive
    turns may go to any worker behind a load balancer. Off: records are written only on
    flush, SIGTERM or trimming (one worker per session; no index call per turn)."""

    remote_timeout: float = field(default=2.0, metadata={"env": "KVCLOUD_REMOTE_TIMEOUT"})
    """Seconds a store or index call may take on the request path before it counts as a miss."""

    cost_model: bool = field(default=True, metadata={"env": "KVCLOUD_COST_MODEL"})
    """Pull a remote hit only when the measured store speed beats recomputing it."""

    tenant: str = field(default="default", metadata={"env": "KVCLOUD_TENANT"})
    """Tenant of every request when no API keys are configured (unused when they are)."""

    api_keys_file: str | None = field(default=None, metadata={"env": "KVCLOUD_API_KEYS_FILE"})
    """File of '<key> <tenant>' lines (see workers.http.auth); requests must then carry a key."""

    api_keys: str | None = field(default=None, repr=False, metadata={"env": "KVCLOUD_API_KEYS"})
    """'key1=tenantA,key2=tenantB'; env only (a flag would show keys in process listings)."""

    api_key_map: ApiKeys | None = field(default=None, init=False, repr=False, compare=False)
    """The parsed keys (None: no authentication); loaded here so a bad file fails at startup."""

    def __post_init__(self) -> None:
        if self.store is not None and self.store.strip().lower() in ("", "none"):
            self.store = None
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {', '.join(WRITE_POLICIES)}")
        if self.cache_pages < 2:
            raise ValueError("cache_pages must be at least 2")
        if self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be positive")
        if self.kv_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError("kv_dtype must be float16, bfloat16 or float32")
        if self.kv_codec not in ("lossless", "int8"):
            raise ValueError("kv_codec must be lossless or int8")
        if self.model_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise ValueError("model_dtype must be auto, float16, bfloat16 or float32")
        if self.model_path is not None and not self.model_path.strip():
            self.model_path = None
        if self.store is not None and not self.index:
            raise ValueError("a store needs an index (--index or KVCLOUD_INDEX)")
        # ApiKeyError is a ValueError, so the CLI reports it as a configuration error
        self.api_key_map = load_api_keys(self.api_keys_file, self.api_keys)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> WorkerOptions:
        values = env_values(cls, env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
