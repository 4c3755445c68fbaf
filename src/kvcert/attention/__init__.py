"""Certified attention reads over a :class:`~kvcert.cache.store.LayerStore`: one read path
(:class:`~kvcert.attention.read_path.ReadPath`: certify → gate → repair → record) with its variants — the dense
read (:func:`certified_read`), the RC tiered read with its fallback ladder (:func:`ladder_read`) and the resident
set (:mod:`kvcert.attention.resident`)."""

from kvcert.attention.certified import ReadConfig, ReadResult, certified_read
from kvcert.attention.exact import ExactAttention
from kvcert.attention.ladder import LadderConfig, LadderStats, ladder_read
from kvcert.attention.read_path import (
    CertifiedReadPath,
    LadderReadPath,
    ReadOutcome,
    ReadPath,
    ReadRequest,
    ReadSink,
    Recorder,
    ResidentReadPath,
)

__all__ = [
    "CertifiedReadPath",
    "ExactAttention",
    "LadderConfig",
    "LadderReadPath",
    "LadderStats",
    "ReadConfig",
    "ReadOutcome",
    "ReadPath",
    "ReadRequest",
    "ReadResult",
    "ReadSink",
    "Recorder",
    "ResidentReadPath",
    "certified_read",
    "ladder_read",
]
