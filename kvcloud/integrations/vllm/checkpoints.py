"""What pins a checkpoint in a namespace: a digest of its weight files and config.

A local folder is read as it is; a hub id is resolved to the snapshot vLLM loads. Used for
the model itself (keys.vllm_namespace) and for a speculative drafter's own checkpoint
(drafters.drafter_digest).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ...errors import ConfigError


def _digest_files(folder: Path) -> str:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ConfigError(f"{folder}: no weight files (*.safetensors, *.bin) to pin the namespace")
    config = folder / "config.json"
    h = hashlib.sha256()
    for f in [*files, *([config] if config.is_file() else [])]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return "sha256-" + h.hexdigest()


def hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local snapshot folder vLLM loads a hub model from (its name is the commit)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not downloaded (yet), or not a hub id: the caller says what to do
        return None


def checkpoint_digest(model: str, revision: str | None = None) -> str:
    """SHA-256 over a checkpoint's weight files and config.json (names and bytes).

    A local folder is read as it is. A hub id is resolved to the snapshot vLLM loads (the
    revision — a branch such as ``main`` moves — is resolved to its commit by the local hub
    cache) and that snapshot's files are digested, so a branch that moved to other weights
    is another namespace. A hub model with no local snapshot cannot be pinned: set
    ``weights_digest``.
    """
    path = Path(model)
    if path.is_dir():
        return _digest_files(path)
    snapshot = hub_snapshot(model, revision)
    if snapshot is None:
        raise ConfigError(
            f"{model}@{revision or 'main'}: no local snapshot of this hub model to pin the "
            "namespace to (a branch name moves); download it first, or set "
            "kv_connector_extra_config.weights_digest (KVCLOUD_WEIGHTS_DIGEST)"
        )
    return _digest_files(snapshot)


__all__ = ["checkpoint_digest", "hub_snapshot"]
