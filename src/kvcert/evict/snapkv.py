"""SnapKV: attention of the last ``window`` queries, pooled over neighbour slots, plus the window (§11.6)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState

Pooling = Literal["avgpool", "maxpool"]


def pool_scores(scores: Tensor, kernel: int, pooling: Pooling) -> Tensor:
    """1-D pooling of ``scores[B, H, S]`` over the slot axis (stride 1, zero padding ``kernel // 2``)."""
    b, h, s = scores.shape
    flat = scores.reshape(b * h, 1, s)
    if pooling == "avgpool":
        out = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out.reshape(b, h, s)


class SnapKV(EvictionPolicy):
    """``SnapKV(window, kernel, pooling)``: score_i = pool(Σ_{s in last window queries} a_{s,i}); the last
    ``window`` positions are protected. ``kernel`` odd. Decode mode applies the same score to the last
    ``window`` observed query rows; pooling runs over physical slots (neighbours after eviction).
    """

    def __init__(self, window: int = 32, kernel: int = 5, pooling: Pooling = "avgpool", sinks: int = 0) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if kernel <= 0 or kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, got {kernel}")
        if pooling not in ("avgpool", "maxpool"):
            raise ValueError(f"pooling must be 'avgpool' or 'maxpool', got {pooling!r}")
        super().__init__(sinks=sinks, recent=window)
        self.window, self.kernel, self.pooling = window, kernel, pooling

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: np.ndarray) -> None:
        # O(1) per step: keep the query groups covering the last ``window`` rows; they are mapped through
        # evictions and stacked only when a score is needed (once per eviction)
        state.add_rows(attn[:, :, -self.window :].clone() if attn.shape[2] > self.window else attn)
        sizes = [r.shape[2] for r in state.rows]
        drop = 0
        while sum(sizes[drop + 1 :]) >= self.window:
            drop += 1
        state.drop_rows(drop)

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        groups = [state.row(i) for i in range(len(state.rows))]
        at = min(sum(g.shape[2] for g in groups), self.window)
        recent = torch.zeros(*state.buffers[0].shape[:2], at, state.n, dtype=torch.float64)  # the last rows
        for g in reversed(groups):
            m = min(g.shape[2], at)
            recent[:, :, at - m : at, : g.shape[-1]] = g[:, :, g.shape[2] - m :]
            at -= m
        state.drop_rows(len(groups))
        state.add_rows(recent)  # one group, already over the current slots
        return pool_scores(recent.sum(2), self.kernel, self.pooling)

    def _prefill_scores(self, layer: int, attn: Tensor | None, positions: Tensor, kappa: Tensor | None) -> Tensor:
        assert attn is not None
        return pool_scores(attn[:, :, -self.window :, :].sum(2), self.kernel, self.pooling)
