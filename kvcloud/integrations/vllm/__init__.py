"""kvcloud as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``).

Select it with::

    --kv-transfer-config '{"kv_connector": "KVCloudConnector",
                           "kv_connector_module_path": "kvcloud.integrations.vllm",
                           "kv_role": "kv_both"}'

Importing this package imports vLLM (and torch); ``import kvcloud`` never does. See
docs/VLLM.md for settings, layout conversion and failure handling.
"""

from .connector import KVCloudConnector, KVCloudConnectorError

__all__ = ["KVCloudConnector", "KVCloudConnectorError"]
