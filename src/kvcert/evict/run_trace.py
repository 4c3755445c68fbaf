"""The exact attention trace of one cache run, and the kept-set overlap of the run's policy with Belady on it.

A decode-budget run reads in *forwards* (a prefill of ``q`` tokens, then one token per step). For every
forward ``t`` and layer the cache records, in validate mode (its host tier still holds every evicted key):

- the exact attention rows of the forward's queries over **every** position written so far (kept and
  evicted), averaged over each KV head's query heads: row ``s`` of ``attn[T, L, Hkv, T]``;
- the logical positions the layer's KV heads held during that read (the policy's kept set ``P_t``);
- the correctness weight κ of each query once it arrives (``κ = 1`` for a query whose κ never came).

``overlap`` then builds ``Belady(attn, κ)`` for the run (per batch row), drives it with the same schedule
(same forwards, ``select(layer, budget, chunk)`` before each forward's tokens are appended, exactly as the
cache does) and returns, per (forward, layer, row, KV head), ``|P_t ∩ R_t| / |R_t|`` with ``R_t`` Belady's
present set at the same read. Reads where neither set has evicted anything are NaN (both hold everything).
Belady here is realisable and is *not* a ceiling (see ``belady.py``); the overlap is an **empirical** reading
of how close the policy's choices came to the clairvoyant rule on the trace the run itself produced.
Memory: the dense trace is ``O(T² · L · Hkv)`` float64 per batch row — a validation tool for short runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcert.evict.base import F64
from kvcert.evict.belady import Belady, BeladyVariant


@dataclass(frozen=True)
class _Read:
    step: int
    layer: int
    queries: Tensor  # [B, q] logical positions of the forward's queries
    rows: Tensor  # [B, Hkv, q, T_now] exact attention in position space (mean over each group)
    kept: Tensor  # [B, Hkv, S] logical positions held during the read


class RunTrace:
    """Recorder for one run (see module doc); ``budget``/``chunk`` are the cache's decode-budget settings."""

    def __init__(self, n_layers: int, budget: int, chunk: int = 1) -> None:
        if n_layers <= 0 or budget <= 0 or not 1 <= chunk <= budget:
            raise ValueError(
                f"need n_layers > 0, budget > 0 and 1 <= chunk <= budget, got {n_layers}, {budget}, {chunk}"
            )
        self.n_layers, self.budget, self.chunk = n_layers, budget, chunk
        self._reads: list[_Read] = []
        self._kappa: dict[int, Tensor] = {}  # logical position -> κ [B]

    def record_read(self, step: int, layer: int, probs: Tensor, positions: Tensor, kept: Tensor) -> None:
        """One read: ``probs[B, Hkv, q, S_all]`` exact attention (mean over each group) over the slots whose
        logical positions are ``positions[B, Hkv, S_all]`` (kept and evicted), ``kept[B, Hkv, S]`` the
        positions the layer held. The ``q`` queries are the newest ``q`` logical positions."""
        b, h, q, s_all = probs.shape
        if positions.shape != (b, h, s_all) or kept.shape[:2] != (b, h) or not 0 <= layer < self.n_layers:
            raise ValueError(
                f"probs {tuple(probs.shape)}, positions {tuple(positions.shape)} and kept "
                f"{tuple(kept.shape)} disagree (layer {layer} of {self.n_layers})"
            )
        t_now = int(positions.max()) + 1
        rows = torch.zeros(b, h, q, t_now, dtype=F64, device=probs.device)
        rows.scatter_add_(-1, positions[:, :, None, :].expand(b, h, q, s_all).long(), probs.to(F64))
        queries = torch.arange(t_now - q, t_now, device=probs.device).expand(b, q)
        self._reads.append(_Read(step, layer, queries, rows, kept.long().clone()))

    def record_kappa(self, positions: Tensor, kappa: Tensor) -> None:
        """κ ``[B, q]`` of the queries at logical ``positions[B, q]`` (the cache's ``set_kappa``)."""
        for j in range(positions.shape[1]):
            self._kappa[int(positions[0, j])] = kappa[:, j].to(F64).clone()

    def dense(self, row: int = 0) -> tuple[Tensor, Tensor]:
        """Batch row ``row`` of the run as ``(attn[T, L, Hkv, T], kappa[T])`` (Belady's input, float64): row ``s``
        of ``attn`` is the exact attention of the query at position ``s``; ``κ = 1`` where none arrived."""
        if not self._reads:
            raise ValueError("nothing recorded yet")
        t_total = max(r.rows.shape[-1] for r in self._reads)
        dev = self._reads[0].rows.device
        attn = torch.zeros(t_total, self.n_layers, self._reads[0].kept.shape[1], t_total, dtype=F64, device=dev)
        for r in self._reads:
            attn[r.queries[row], r.layer, :, : r.rows.shape[-1]] = r.rows[row].permute(1, 0, 2)
        kappa = torch.ones(t_total, dtype=F64, device=dev)
        for pos, k in self._kappa.items():
            if pos < t_total:
                kappa[pos] = k[row]
        return attn, kappa

    def overlap(self, variant: BeladyVariant = "next_use", threshold: float = 0.01) -> Tensor | None:
        """``|P ∩ R| / |R|`` per (forward step, layer, row, KV head) ``[steps, L, B, Hkv]`` (module doc), NaN
        where neither set has evicted anything or the layer was not read; ``None`` before any read."""
        if not self._reads:
            return None
        steps = max(r.step for r in self._reads) + 1
        b, h = self._reads[0].kept.shape[:2]
        dev = self._reads[0].rows.device
        out = torch.full((steps, self.n_layers, b, h), math.nan, dtype=F64, device=dev)
        for row in range(b):
            self._drive(Belady(*self.dense(row), variant, threshold), row, out)
        return out

    def _drive(self, oracle: Belady, row: int, out: Tensor) -> None:
        """Replay the run's schedule on ``oracle`` for batch row ``row`` and fill ``out`` (module doc)."""
        held: dict[int, Tensor] = {}
        for r in self._reads:
            dev = r.kept.device
            pos = held.get(r.layer, torch.empty(1, r.kept.shape[1], 0, dtype=torch.long, device=dev))
            if r.layer in held:
                keep = oracle.select(r.layer, self.budget, self.chunk)
                if keep is not None:
                    pos = pos.gather(-1, keep)
                    oracle.on_evict(r.layer, keep)
            q = r.queries.shape[1]
            pos = torch.cat([pos, r.queries[row : row + 1, None, :].expand(1, pos.shape[1], q)], -1)
            held[r.layer] = pos
            oracle.observe(r.layer, torch.zeros(1, pos.shape[1], q, pos.shape[-1], dtype=F64, device=dev), pos)
            written = int(r.queries[row, -1]) + 1
            if pos.shape[-1] == written and r.kept.shape[-1] == written:
                continue  # nothing evicted by either: NaN
            mine = torch.zeros(pos.shape[1], written, dtype=torch.bool, device=dev).scatter_(-1, r.kept[row], True)
            both = mine.gather(-1, pos[0]).sum(-1)
            out[r.step, r.layer, row] = both.to(F64) / pos.shape[-1]
