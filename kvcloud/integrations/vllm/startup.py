"""What the connector says and checks at start, so a misconfigured server is loud.

A server whose ``KVCLOUD_STORE``/``KVCLOUD_INDEX`` are unset runs on the embedded default
(a private ``file://`` store and ``sqlite://`` index under ``~/.cache``) and shares with no
one; one whose ``KVCLOUD_SECRET`` differs from its peers' never finds their chunks. Neither
fails a request, so both would be silent: the start line names the store, index, load mode
and a key id (comparable across servers, ``namespace.key_id``), the same fields go on
``/metrics`` as ``vllm:kvcloud_info``, the embedded default is a warning, and ``require``
turns all of it, plus a probe of the backends, into a refusal to start.

No vLLM or torch import here (the settings are checked without either).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ... import __version__
from ...config import KVCloudConfig
from ...errors import ConfigError, KVCloudError
from ...namespace import key_id
from ...urls import redact_url
from .config import VLLMConnectorConfig

log = logging.getLogger("vllm.kvcloud")

# labels of vllm:kvcloud_info, beside vLLM's own (model_name, engine)
INFO_LABELS = ("version", "key_id", "store", "index", "tenant", "load_mode", "write_policy")


def identity(cfg: VLLMConnectorConfig, client: KVCloudConfig) -> dict[str, str]:
    """The fields two servers must agree on to share, none of them secret."""
    kid = key_id(client.secret, cfg.tenant)
    return {
        "version": __version__,
        "key_id": f"{kid} (insecure default secret)" if client.insecure_secret else kid,
        "store": redact_url(client.store),
        "index": redact_url(client.index),
        "tenant": cfg.tenant,
        "load_mode": cfg.load_mode,
        "write_policy": cfg.write_policy,
    }


def info_labels(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> dict:
    """``identity`` as vLLM's API server process computes it for ``vllm:kvcloud_info``
    (the engine's processes inherit its environment); a setting that does not parse gives
    ``invalid`` labels here and stops the engine with the reason."""
    try:
        cfg = VLLMConnectorConfig.load(extra, env)
        return identity(cfg, cfg.client_config(env))
    except KVCloudError:
        return dict.fromkeys(INFO_LABELS, "invalid")


def check_at_start(cfg: VLLMConnectorConfig, client: KVCloudConfig) -> None:
    """Warn about the embedded default; with ``require``, refuse it, the insecure default
    secret, and backends that fail a real probe (bounded in time): a ConfigError whose one
    line says what to set."""
    unset = cfg.embedded
    if unset and not cfg.require:
        log.warning(
            "kvcloud: %s unset: this server uses the embedded default (store %s, index %s) "
            "on this machine only and shares KV with no other server; set %s (and "
            "KVCLOUD_REQUIRE=1 to refuse to start without them)",
            " and ".join(unset),
            redact_url(client.store),
            redact_url(client.index),
            " and ".join(unset),
        )
    if not cfg.require:
        return
    if unset:
        raise ConfigError(
            f"KVCLOUD_REQUIRE is set but {' and '.join(unset)} "
            f"{'is' if len(unset) == 1 else 'are'} unset (the embedded default shares with "
            f"no one): set {' and '.join(unset)}"
        )
    if client.insecure_secret:
        raise ConfigError(
            "KVCLOUD_REQUIRE is set but KVCLOUD_SECRET is unset (the built-in development "
            "secret lets anyone compute your fingerprints): set KVCLOUD_SECRET, the same on "
            "every server that shares"
        )
    from ...probe import probe

    probe(client, timeout=cfg.probe_timeout)
