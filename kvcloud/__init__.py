"""kvcloud: a distributed KV-cache snapshot store for LLM inference.

Workers push evicted KV segments as content-addressed objects to S3-compatible storage and
register prefix fingerprints in an index; any worker can then look up a prompt's longest
cached prefix in one round trip and pull it instead of recomputing the prefill.
"""

from .client import ChunkRef, KVCloud, Match, PullResult, PushResult, SessionRecord
from .config import KVCloudConfig
from .errors import (
    BatchSizeError,
    ConfigError,
    CorruptObjectError,
    IndexBackendError,
    IndexUnavailableError,
    KVCloudError,
    LayoutError,
    ObjectNotFoundError,
    PushError,
    SessionNotFoundError,
    StoreError,
    StoreUnavailableError,
    UnsupportedCacheError,
)
from .namespace import Namespace, chunk_fingerprints, derive_tenant_key

__version__ = "0.1.0"

__all__ = [
    "BatchSizeError",
    "ChunkRef",
    "ConfigError",
    "CorruptObjectError",
    "IndexBackendError",
    "IndexUnavailableError",
    "KVCloud",
    "KVCloudConfig",
    "KVCloudError",
    "LayoutError",
    "Match",
    "Namespace",
    "ObjectNotFoundError",
    "PullResult",
    "PushError",
    "PushResult",
    "SessionNotFoundError",
    "SessionRecord",
    "StoreError",
    "StoreUnavailableError",
    "UnsupportedCacheError",
    "__version__",
    "chunk_fingerprints",
    "derive_tenant_key",
]
