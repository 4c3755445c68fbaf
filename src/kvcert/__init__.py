"""kvcert: runtime-certified, observable and repairable KV-cache compression.

Every attention read over a compressed cache gets a sound upper bound on the error compression
causes, per (layer, query head, decode step); a gate repairs from an exact host copy when the bound
is too large.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvcert import bounds

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from kvcert.attention.evict_driver import EvictionConfig
    from kvcert.cache.gate import Gate
    from kvcert.integrations.cache_config import StorageConfig, ValidationConfig
    from kvcert.integrations.transformers import CertifiedCache

_LAZY = {
    "CertifiedCache": ("kvcert.integrations.transformers", "CertifiedCache"),
    "Gate": ("kvcert.cache.gate", "Gate"),
    "EvictionConfig": ("kvcert.attention.evict_driver", "EvictionConfig"),
    "StorageConfig": ("kvcert.integrations.cache_config", "StorageConfig"),
    "ValidationConfig": ("kvcert.integrations.cache_config", "ValidationConfig"),
}


def __getattr__(name: str) -> Any:
    """Import heavy entry points (transformers glue) only when first used."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in {
        "quant",
        "contracts",
        "cache",
        "attention",
        "evict",
        "ledger",
        "probe",
        "integrations",
        "serving",
        "models",
        "eval",
        "report",
    }:
        return importlib.import_module(f"kvcert.{name}")
    raise AttributeError(f"module 'kvcert' has no attribute {name!r}")


__all__ = ["CertifiedCache", "EvictionConfig", "Gate", "StorageConfig", "ValidationConfig", "__version__", "bounds"]
