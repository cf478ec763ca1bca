"""radixcache inside vLLM: :class:`RadixcacheConnector`, a KV connector for hybrid models.

Load it with ``KVTransferConfig(kv_connector="RadixcacheConnector",
kv_connector_module_path="radixcache.vllm", kv_role="kv_both", kv_connector_extra_config={...})``
(docs/vllm.md). Importing this package does not import vLLM: the connector class is loaded on
first use (vLLM's loader asks for it by name), so :mod:`radixcache.vllm.store`,
:mod:`radixcache.vllm.memory` and :mod:`radixcache.vllm.options` work without vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .memory import StoreBytes, StoreMapping
from .options import ConnectorOptions, UnsupportedEngine
from .store import VERIFYING, Hit, LookupState, PageCorruption, PagedHostStore, PagedLayout, SavePlan, StoreStats

if TYPE_CHECKING:
    from .connector import RadixcacheConnector

__all__ = [
    "VERIFYING",
    "ConnectorOptions",
    "Hit",
    "LookupState",
    "PageCorruption",
    "PagedHostStore",
    "PagedLayout",
    "RadixcacheConnector",
    "SavePlan",
    "StoreBytes",
    "StoreMapping",
    "StoreStats",
    "UnsupportedEngine",
]


def __getattr__(name: str) -> Any:
    if name == "RadixcacheConnector":
        from .connector import RadixcacheConnector

        return RadixcacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
