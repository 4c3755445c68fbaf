"""Serving above the ledger: a batching server whose per-batch caches report to one
:class:`~kvcert.ledger.ledger.Ledger`, and tensor-parallel-style replica ranks, each with its own ledger
(``docs/ledger.md#concurrency``, ``docs/ledger.md#replicas``)."""

from kvcert.integrations.observed_cache import ObservedDynamicCache
from kvcert.serving.replicas import ReplicaConfig, ReplicaGroup, rank_dir
from kvcert.serving.server import BatchingServer, certified_cache, decode_batch, dynamic_cache

__all__ = [
    "BatchingServer",
    "ObservedDynamicCache",
    "ReplicaConfig",
    "ReplicaGroup",
    "certified_cache",
    "decode_batch",
    "dynamic_cache",
    "rank_dir",
]
