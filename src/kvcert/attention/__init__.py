"""Certified attention reads over a :class:`~kvcert.cache.store.LayerStore`: the dense read path
(:func:`certified_read`) and the RC tiered read with its fallback ladder (:func:`ladder_read`)."""

from kvcert.attention.certified import ReadConfig, ReadResult, certified_read
from kvcert.attention.ladder import LadderConfig, LadderStats, ladder_read

__all__ = ["LadderConfig", "LadderStats", "ReadConfig", "ReadResult", "certified_read", "ladder_read"]
