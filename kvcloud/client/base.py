"""ClientBase: what every part of the KVCloud client shares: its backends, per-tenant keys
and counters.

Encryption at rest is per tenant (``KVCloudConfig.encrypt_tenants``): every push, tail and
pull names its tenant, and the tenant's data key is derived here from the master secret
(crypto.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._closing import Closing
from ..config import KVCloudConfig
from ..crypto import TenantKey, derive_data_key
from ..errors import KVCloudError
from ..indexes.base import Index
from ..namespace import Namespace, chunk_fingerprints, derive_tenant_key
from ..stores.base import ObjectStore

# one logger for the whole client, whichever of its modules logs
log = logging.getLogger("kvcloud.client")


def hex_fps(fps: Sequence[bytes]) -> list[str]:
    """Fingerprints as the index names them."""
    return [fp.hex() for fp in fps]


# derived tenant keys kept per client (a derivation costs a few microseconds)
KEY_CACHE_SIZE = 4096


def _cached(cache: OrderedDict[str, Any], tenant: str, derive: Callable[[], Any]) -> Any:
    """``cache[tenant]``, derived on a miss; the least recently used beyond
    KEY_CACHE_SIZE is forgotten."""
    key = cache.get(tenant)
    if key is None:
        key = cache[tenant] = derive()
        if len(cache) > KEY_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(tenant)
    return key


class ClientBase(Closing):
    """The client's state, which the parts of KVCloud (client.py) share."""

    def __init__(self, store: ObjectStore, index: Index, config: KVCloudConfig | None = None):
        self.store = store
        self.index = index
        self.config = config or KVCloudConfig()
        # derived keys by tenant, least recently used first: bounded, since a tenant scope
        # can be per request (vLLM's cache_salt, a LoRA adapter) and would grow forever
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._data_keys: OrderedDict[str, TenantKey] = OrderedDict()
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()  # not yet added to the index's counters
        if self.config.insecure_secret:
            log.warning(
                "KVCLOUD_SECRET is not set: using the built-in development secret. Anyone "
                "with this code can compute your fingerprints; set a secret in production."
            )

    # -- keys and fingerprints --------------------------------------------------------------

    def _tenant(self, tenant: str | None) -> str:
        return tenant if tenant is not None else self.config.tenant

    def tenant_key(self, tenant: str | None = None) -> bytes:
        t = self._tenant(tenant)
        with self._lock:
            return _cached(self._keys, t, lambda: derive_tenant_key(self.config.secret, t))

    def data_key(self, tenant: str | None = None) -> TenantKey:
        """The tenant's encryption key (derived from the master secret, cached). Used to
        decrypt whatever the tenant finds encrypted, whether or not it encrypts new pushes."""
        t = self._tenant(tenant)
        with self._lock:
            return _cached(self._data_keys, t, lambda: derive_data_key(self.config.secret, t))

    def encrypts(self, tenant: str | None = None) -> bool:
        """Whether this tenant's segments are encrypted at rest (KVCLOUD_ENCRYPT_TENANTS)."""
        return self.config.encrypts(self._tenant(tenant))

    def _write_key(self, tenant: str | None) -> TenantKey | None:
        return self.data_key(tenant) if self.encrypts(tenant) else None

    def session_scope(self, tenant: str | None = None) -> str:
        """Index scope of a tenant's sessions: derived from its key, so it is unguessable."""
        key = self.tenant_key(tenant)
        return hashlib.blake2b(key, digest_size=16, person=b"kvc-scope-v1").hexdigest()

    def fingerprints(
        self, ns: Namespace, tokens: Sequence[int] | np.ndarray, tenant: str | None = None
    ) -> list[bytes]:
        return chunk_fingerprints(ns, tokens, self.tenant_key(tenant))

    # -- statistics -------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                if v:
                    self._stats[k] += v
                    self._pending[k] += v

    def _drain_pending(self) -> dict[str, int]:
        with self._lock:
            pending = dict(self._pending)
            self._pending.clear()
        return pending

    def _restore_pending(self, pending: Mapping[str, int]) -> None:
        with self._lock:
            self._pending.update(pending)

    def _flush_counters(self) -> None:
        pending = self._drain_pending()
        if not pending:
            return
        try:
            self.index.incr(pending)
        except KVCloudError as exc:
            log.warning("could not flush counters to the index: %s", exc)

    def stats(self) -> dict[str, int]:
        """This client's counters since it was opened."""
        with self._lock:
            return dict(self._stats)
