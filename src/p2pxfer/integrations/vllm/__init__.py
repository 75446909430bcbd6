"""vLLM's KV connector over the p2pxfer daemon:
``--kv-transfer-config '{"kv_connector": "P2PXferConnector",
"kv_connector_module_path": "p2pxfer.integrations.vllm", "kv_role": ...}'``
(README, "Using p2pxfer from vLLM").

Only this package's ``_connector`` imports vLLM, and only when
``P2PXferConnector`` is first asked for (vLLM's factory does
``getattr(module, name)``): the worker and scheduler halves and their
tests need no vLLM, and ``import p2pxfer`` never loads it.
"""

import importlib
from typing import Any

__all__ = ["P2PXferConnector", "P2PXferMetadata"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}._connector"), name)
    globals()[name] = value
    return value
