"""kvcloud as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``).

Select it with::

    --kv-transfer-config '{"kv_connector": "KVCloudConnector",
                           "kv_connector_module_path": "kvcloud.integrations.vllm",
                           "kv_role": "kv_both"}'

The connector class is imported on first use (``KVCloudConnector`` pulls in vLLM and torch);
the settings (``config``) and namespace helpers (``keys``) import neither, so tools and tests
outside vLLM's environment can use them. See docs/VLLM.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCloudConnector", "KVCloudConnectorError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
