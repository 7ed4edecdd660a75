"""Settings of the vLLM connector: ``kv_connector_extra_config`` over ``KVCLOUD_*`` variables.

Each field names its environment variable; a key of the same name in
``--kv-transfer-config '{"kv_connector_extra_config": {...}}'`` wins over the variable. The
master secret is read from ``KVCLOUD_SECRET`` only: a secret in a command line ends up in
``ps`` output and in vLLM's own config log.

No vLLM or torch import here, so the settings can be checked (and tested) without either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ...breaker import CircuitBreaker
from ...config import KVCloudConfig, env_values
from ...errors import ConfigError
from ...namespace import DEFAULT_CHUNK_TOKENS

WRITE_POLICIES = ("write-through", "off")
LOAD_MODES = ("async", "sync", "auto")


@dataclass
class VLLMConnectorConfig:
    """What ``KVCloudConnector`` reads at start (scheduler and worker processes alike)."""

    store: str = field(default="", metadata={"env": "KVCLOUD_STORE"})
    """Object store URL (``s3://bucket/prefix?endpoint_url=…``, ``file:///path``); empty:
    kvcloud's default ``file://~/.cache/kvcloud/objects``."""

    index: str = field(default="", metadata={"env": "KVCLOUD_INDEX"})
    """Index URL (``redis://host:6379/0``, ``redis+cluster://…``, ``sqlite:///path``); empty:
    kvcloud's default ``sqlite://~/.cache/kvcloud/index.db``."""

    require: bool = field(default=False, metadata={"env": "KVCLOUD_REQUIRE"})
    """Refuse to start, with one line saying why, unless this server can share: the store
    and index are set (not the embedded default, a private ``file://`` + ``sqlite://``
    under ``~/.cache`` on this machine), ``KVCLOUD_SECRET`` is set, and a write, read and
    delete of a probe object and an index round trip succeed at start (bounded by
    ``2 × (connect_timeout + read_timeout)``). For a fleet: a pod that would run alone, or
    against a missing bucket or refused credentials, never becomes ready."""

    tenant: str = field(default="default", metadata={"env": "KVCLOUD_TENANT"})
    """Tenant whose fingerprint key this vLLM uses. A request's ``cache_salt`` is folded into
    it, so requests with different salts never share KV."""

    chunk_tokens: int = field(
        default=DEFAULT_CHUNK_TOKENS, metadata={"env": "KVCLOUD_CHUNK_TOKENS"}
    )
    """Tokens per stored segment; a multiple of vLLM's ``--block-size`` (checked at start)."""

    write_policy: str = field(default="write-through", metadata={"env": "KVCLOUD_WRITE_POLICY"})
    """``write-through``: push every new full chunk of a request as soon as its KV is
    computed (prompt chunks during the prefill, answer chunks while decoding); ``off``: only
    read. (vLLM does not tell a connector when it evicts a block, so write-back on eviction,
    the kvcloud worker's default, is not available here.)"""

    save_decode: bool = field(default=True, metadata={"env": "KVCLOUD_SAVE_DECODE"})
    """Also push the full chunks a request fills while decoding: in a chat, turn n's answer
    is part of turn n+1's prompt, so a conversation moving to another server restores its
    answers too instead of recomputing them. ``false``: prompt chunks only."""

    load_mode: str = field(default="auto", metadata={"env": "KVCLOUD_LOAD_MODE"})
    """``auto`` (the default): in the step when the restore is measured to take at most
    ``sync_budget_ms`` at the rate this vLLM's restores have been running, beside the pass
    otherwise (and while no rate is known yet). ``async``: a request being restored waits in
    vLLM's WAITING_FOR_REMOTE_KVS state while its chunks are pulled and verified off the
    forward pass; the requests already decoding never wait for it. ``sync``: the restore
    runs inside the step that schedules the request, before its forward pass, which saves the
    request one scheduler step but makes every request in that batch wait for the pull, up to
    ``load_timeout``. docs/VLLM.md has the measurements."""

    sync_budget_ms: float = field(default=50.0, metadata={"env": "KVCLOUD_SYNC_BUDGET_MS"})
    """``load_mode=auto``: the longest a restore may be expected to take and still run inside
    the step (every request in the batch waits for it). A restore in the step that runs past
    four times this is abandoned and its tokens recomputed, so one slow pull stalls the batch
    a bounded time whatever ``load_timeout`` says."""

    load_timeout: float = field(default=2.0, metadata={"env": "KVCLOUD_LOAD_TIMEOUT"})
    """Seconds a restore may pull, from when its pull starts, before it is given up; the
    blocks not loaded by then are recomputed, and the store is blamed (its breaker, the
    object remembered as bad). A restore still queued behind others on this worker that long
    after it was submitted is given up too, for its request only: local queueing is not a
    store outage. With ``load_mode=async`` only the request being restored waits, never the
    requests already decoding; with ``sync`` this bounds the stall of a step (queueing
    included, at most twice this)."""

    lookup_wait_ms: float = field(default=20.0, metadata={"env": "KVCLOUD_LOOKUP_WAIT_MS"})
    """Milliseconds the scheduler waits, the first time vLLM asks, for a request's index
    lookup (a healthy lookup answers in a few; the wait ends as soon as it does). vLLM asks
    right after the request arrives, so the lookup has only this long before the step is
    scheduled; one still out is asked about again at the next step (later asks do not wait)
    while the engine goes on with every other request, which costs the request a whole
    engine step: under load 2 ms deferred nearly every request here (docs/VLLM.md)."""

    lookup_timeout: float = field(default=1.0, metadata={"env": "KVCLOUD_LOOKUP_TIMEOUT"})
    """Seconds a new request waits for its lookup in all; after that it runs as a miss and
    the lookup counts as a failure of the index."""

    breaker_failures: int = field(default=3, metadata={"env": "KVCLOUD_BREAKER_FAILURES"})
    """Consecutive failures of the index, or of the store, after which no request touches
    it for a backoff window. One timeout (a lookup past ``lookup_timeout``, a restore past
    ``load_timeout``) opens it at once: it already cost its request the whole wait."""

    breaker_backoff: float = field(default=1.0, metadata={"env": "KVCLOUD_BREAKER_BACKOFF"})
    """Seconds of the first backoff window; after it one probe goes through, and each failed
    probe doubles the window."""

    breaker_max_backoff: float = field(
        default=30.0, metadata={"env": "KVCLOUD_BREAKER_MAX_BACKOFF"}
    )
    """Longest backoff window, in seconds."""

    failure_memory: float = field(default=60.0, metadata={"env": "KVCLOUD_FAILURE_MEMORY"})
    """Seconds an object whose pull failed or timed out is remembered: requests are not
    offered it (or anything after it in their prompt) meanwhile."""

    load_threads: int = field(default=4, metadata={"env": "KVCLOUD_LOAD_THREADS"})
    """Restores beside the forward pass in flight at once per worker (each pulls its chunks
    in parallel). Restores in the step (``sync``, ``auto`` when short) have threads of their
    own, so they never queue behind these; uploads have their own client and threads, so
    they never delay a load."""

    upload_queue: int = field(default=64, metadata={"env": "KVCLOUD_UPLOAD_QUEUE"})
    """Chunks waiting for upload at most; when full, new ones are dropped and counted."""

    head_parts: int = field(default=1, metadata={"env": "KVCLOUD_HEAD_PARTS"})
    """Store each chunk as this many objects, one per equal range of KV heads (at least the
    tensor-parallel size: a TP-4 vLLM always stores 4). A rank of a larger TP size reading a
    chunk stored in fewer parts downloads the parts overlapping its heads and keeps its own:
    a TP-8 rank reading a chunk a TP-1 vLLM stored whole downloads 8× what it uses. A fleet
    that mixes TP sizes sets this to its largest, on every server: each rank then reads
    exactly its heads, for more (smaller) PUTs per chunk and more GETs for smaller TP sizes.
    Must divide the model's KV heads (checked at start)."""

    upload_nice: int = field(default=19, metadata={"env": "KVCLOUD_UPLOAD_NICE"})
    """Nice value (0–19, Linux) of the uploader's threads. A save's hashing, encryption and
    writing then take the idle time of the cores vLLM runs on instead of a slice of its
    steps (on a CPU server they share the forward pass's core; on a GPU server, the core
    that schedules and launches the steps); a chunk waits in the queue meanwhile.
    0: the uploader runs at vLLM's own priority (docs/VLLM.md has the measurements)."""

    drain_seconds: float = field(default=0.0, metadata={"env": "KVCLOUD_DRAIN_SECONDS"})
    """At stop, the longest the uploader pushes the chunks still queued before it gives up
    on the rest (logged, counted as ``upload_dropped_at_stop``). 0: as long as vLLM lets a
    stopping worker live, less a margin (``uploader.stop_budget``: 4 s with vLLM's
    defaults); more than that is never used, since vLLM would kill the worker mid-push.
    vLLM's default ``--shutdown-timeout 0`` kills the engine at once on SIGTERM: a server
    that should keep its last saves needs more (docs/VLLM.md, "Stopping")."""

    min_hit_tokens: int = field(default=0, metadata={"env": "KVCLOUD_MIN_HIT_TOKENS"})
    """A kvcloud hit shorter than this (beyond vLLM's own prefix cache) is not loaded."""

    cost_margin: float = field(default=1.25, metadata={"env": "KVCLOUD_COST_MARGIN"})
    """A hit is loaded only where restoring it is expected to take at most 1/margin of the
    time vLLM would take to compute it (invariant 5, never slower than recompute): the
    expected restore time is its bytes over the restore rate the workers measure, the
    compute time its tokens over the prefill rate they measure. Of a long hit, the longest
    part that pays is loaded, the rest computed. Until both rates are measured every hit is
    loaded (as with 0, which turns the guard off). docs/VLLM.md, "Never slower than
    recompute", has how the default was chosen."""

    cost_reprobe_s: float = field(default=60.0, metadata={"env": "KVCLOUD_COST_REPROBE_S"})
    """While the guard skips every hit, one hit per this many seconds loads its first chunk
    anyway (``cost_probes``), so a store that got faster is seen again."""

    codec: str = field(default="raw", metadata={"env": "KVCLOUD_CODEC"})
    """Codec for new segments: raw, zstd or lz4 (lossless)."""

    weights_digest: str = field(default="", metadata={"env": "KVCLOUD_WEIGHTS_DIGEST"})
    """Pins the weights in the namespace. Empty: SHA-256 over the checkpoint's weight files
    (read once at start); set it to a known digest to skip reading large checkpoints."""

    max_connections: int = field(default=16, metadata={"env": "KVCLOUD_MAX_CONNECTIONS"})
    """Parallel transfers per process."""

    staging_mib: int = field(default=512, metadata={"env": "KVCLOUD_STAGING_MIB"})
    """Host memory (MiB; pinned on a GPU) every restore's pulled chunks stream through
    before they are written into vLLM's blocks: one ring, allocated once by the first
    restore, reused by all (no page faults, no allocation on the forward thread). Restores
    needing more than it holds at once pull their chunks in groups; it always holds at least
    one chunk (0: exactly one)."""

    connect_timeout: float = field(default=2.0, metadata={"env": "KVCLOUD_CONNECT_TIMEOUT"})
    """Seconds to connect to the store or index."""

    read_timeout: float = field(default=5.0, metadata={"env": "KVCLOUD_READ_TIMEOUT"})
    """Seconds to wait for a store or index reply: bounds how long the scheduler's lookup
    can stall."""

    @classmethod
    def load(
        cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> VLLMConnectorConfig:
        values = env_values(cls, env)
        known = {f.name for f in fields(cls)}
        for key, value in (extra or {}).items():
            if key in ("secret", "KVCLOUD_SECRET"):
                raise ConfigError(
                    "kv_connector_extra_config must not carry the secret; set KVCLOUD_SECRET"
                )
            if key not in known:
                raise ConfigError(
                    f"unknown kv_connector_extra_config key {key!r}; known: "
                    + ", ".join(sorted(known))
                )
            values[key] = value
        return cls(**values)

    def __post_init__(self) -> None:
        for name in (
            "chunk_tokens",
            "upload_queue",
            "head_parts",
            "max_connections",
            "breaker_failures",
            "load_threads",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if (
            isinstance(self.staging_mib, bool)
            or not isinstance(self.staging_mib, int)
            or (self.staging_mib < 0)
        ):
            raise ConfigError(f"staging_mib must be an integer >= 0, got {self.staging_mib!r}")
        for name in (
            "load_timeout",
            "lookup_timeout",
            "connect_timeout",
            "read_timeout",
            "breaker_backoff",
            "breaker_max_backoff",
            "failure_memory",
            "cost_reprobe_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if (
            isinstance(self.sync_budget_ms, bool)
            or not isinstance(self.sync_budget_ms, int | float)
            or not self.sync_budget_ms > 0
        ):
            raise ConfigError(f"sync_budget_ms must be > 0, got {self.sync_budget_ms!r}")
        if not isinstance(self.lookup_wait_ms, int | float) or self.lookup_wait_ms < 0:
            raise ConfigError(f"lookup_wait_ms must be >= 0, got {self.lookup_wait_ms!r}")
        if self.breaker_max_backoff < self.breaker_backoff:
            raise ConfigError("breaker_max_backoff must be >= breaker_backoff")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy {self.write_policy!r}: use one of {', '.join(WRITE_POLICIES)}"
            )
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode {self.load_mode!r}: use one of {', '.join(LOAD_MODES)}")
        if not isinstance(self.require, bool):
            raise ConfigError(f"require must be true or false, got {self.require!r}")
        if not isinstance(self.save_decode, bool):
            raise ConfigError(f"save_decode must be true or false, got {self.save_decode!r}")
        if (
            isinstance(self.upload_nice, bool)
            or not isinstance(self.upload_nice, int)
            or not 0 <= self.upload_nice <= 19
        ):
            raise ConfigError(f"upload_nice must be an integer 0-19, got {self.upload_nice!r}")
        if (
            isinstance(self.drain_seconds, bool)
            or not isinstance(self.drain_seconds, int | float)
            or not self.drain_seconds >= 0
        ):
            raise ConfigError(f"drain_seconds must be >= 0, got {self.drain_seconds!r}")
        if (
            isinstance(self.cost_margin, bool)
            or not isinstance(self.cost_margin, int | float)
            or not self.cost_margin >= 0
        ):
            raise ConfigError(f"cost_margin must be >= 0 (0: off), got {self.cost_margin!r}")
        if not isinstance(self.min_hit_tokens, int) or self.min_hit_tokens < 0:
            raise ConfigError(f"min_hit_tokens must be >= 0, got {self.min_hit_tokens!r}")

    @property
    def embedded(self) -> list[str]:
        """The variables left unset, so that this server uses the embedded default."""
        return [
            name
            for name, value in (("KVCLOUD_STORE", self.store), ("KVCLOUD_INDEX", self.index))
            if not value
        ]

    @property
    def probe_timeout(self) -> float:
        """The longest the start-time probe of ``require`` may take."""
        return 2 * (self.connect_timeout + self.read_timeout)

    def breaker(self, name: str, clock: Any, on_change: Any = None) -> CircuitBreaker:
        """A circuit breaker for the index or the store, with these settings."""
        return CircuitBreaker(
            name,
            threshold=self.breaker_failures,
            backoff=self.breaker_backoff,
            max_backoff=self.breaker_max_backoff,
            clock=clock,
            on_change=on_change,
        )

    def client_config(self, env: Mapping[str, str] | None = None) -> KVCloudConfig:
        """The kvcloud client settings (secret and encryption from the environment)."""
        return KVCloudConfig.from_env(
            env=dict(os.environ if env is None else env),
            store=self.store or None,
            index=self.index or None,
            tenant=self.tenant,
            codec=self.codec,
            max_connections=self.max_connections,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
        )
