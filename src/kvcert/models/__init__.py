"""Offline model loading: the real small LMs shipped in PyPI packages and tiny random test models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvcert.models.tiny import SLIDING_SHAPES, SUPPORTED_FAMILIES, tiny_config, tiny_random  # noqa: E402
from kvcert.models.zoo import ZOO, ModelPackageMissingError, cache_root, converted_dir, load  # noqa: E402

__all__ = [
    "SLIDING_SHAPES",
    "SUPPORTED_FAMILIES",
    "ZOO",
    "ModelPackageMissingError",
    "cache_root",
    "converted_dir",
    "load",
    "tiny_config",
    "tiny_random",
]
