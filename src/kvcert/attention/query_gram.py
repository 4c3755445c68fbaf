"""Per-layer query Gram matrices: what the query-aware basis of a resident set's summary is built from.

A query-aware summary (``summary="basis8-qspec"``, ``docs/math.md#query-aware-basis``) picks its per-(row, KV head)
basis from the omitted keys *and* the queries the head has read with. :class:`QueryGrams` keeps, per layer, their
second moment ``Q = Σ_m q_m q_mᵀ`` ``[B, Hkv, D, D]`` (float64) summed over every query head of the KV head's group:
the prefill's newest query rows (those the eviction policy reads, :func:`~kvcert.attention.evict_driver.ingest_reads`)
and every decode read's queries. It is bookkeeping for building summaries, which read the host tier's omitted keys
anyway; it is kept beside them in the host tier and never read by a certificate, so it is not a device byte (its
size, ``8·D²`` bytes per (row, KV head) and layer, does not grow with the context). No bound relies on it: any basis
is sound (``docs/math.md#basis-sketch``).
"""

from __future__ import annotations

import torch

F64 = torch.float64


def query_gram(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``Σ_m q_m q_mᵀ`` ``[B, Hkv, D, D]`` float64 of ``query[B, Hq, Q, D]`` over each KV head's group of
    ``Hq / Hkv`` consecutive query heads and every query row. A row with a non-finite entry is left out (fail
    closed: it cannot move the basis); finite float32 or bfloat16 rows cannot overflow float64 squares.
    ``ValueError`` unless ``query`` is 4-d with ``Hq`` a multiple of ``kv_heads``."""
    if query.dim() != 4 or kv_heads < 1 or query.shape[1] % kv_heads:
        raise ValueError(f"query must be [B, Hq, Q, D] with Hq a multiple of {kv_heads}, got {tuple(query.shape)}")
    b, hq, q, d = query.shape
    x = query.to(F64).reshape(b, kv_heads, (hq // kv_heads) * q, d)
    x = torch.where(torch.isfinite(x).all(-1, keepdim=True), x, 0.0)
    return x.transpose(-1, -2) @ x


class QueryGrams:
    """The query Gram of every layer a resident set manages (module doc), accumulated read by read."""

    def __init__(self) -> None:
        self._gram: dict[int, torch.Tensor] = {}

    def add(self, layer: int, gram: torch.Tensor) -> None:
        """Add ``gram[B, Hkv, D, D]`` (:func:`query_gram` of a read, or a recorded prefill's) to ``layer``'s."""
        have = self._gram.get(layer)
        self._gram[layer] = gram.to(F64) if have is None else have + gram.to(have.device, F64)

    def get(self, layer: int) -> torch.Tensor | None:
        """``layer``'s Gram so far, ``None`` before any query of it was added."""
        return self._gram.get(layer)

    def clear(self) -> None:
        """Forget every layer (a new request)."""
        self._gram.clear()
