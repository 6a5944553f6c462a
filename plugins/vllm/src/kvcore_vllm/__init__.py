"""kvcore-vllm: a vLLM V1 KV connector on kvcore.

``kv_connector_module_path`` may be ``"kvcore_vllm"`` or ``"kvcore_vllm.connector"``: both give
:class:`~kvcore_vllm.connector.KvcoreConnector`. ``import kvcore_vllm`` alone does not import vLLM; the connector
is loaded on first use of the name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvcoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvcoreConnector":
        from kvcore_vllm.connector import KvcoreConnector

        return KvcoreConnector
    raise AttributeError(f"module 'kvcore_vllm' has no attribute {name!r}")
