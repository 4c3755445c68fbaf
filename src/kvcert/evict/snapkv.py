"""SnapKV: attention of the last ``window`` queries, pooled over neighbour slots, plus the window (§11.6)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState, fit_slots

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

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        s = attn.shape[-1]
        state.rows = [fit_slots(r, s) for r in state.rows] + [attn]
        recent = torch.cat(state.rows, dim=2)[:, :, -self.window :, :]
        state.rows = [recent]
        state.row_positions = []

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return pool_scores(state.rows[0].sum(2), self.kernel, self.pooling)

    def _prefill_scores(self, layer: int, attn: Tensor | None, positions: Tensor, kappa: Tensor | None) -> Tensor:
        assert attn is not None
        return pool_scores(attn[:, :, -self.window :, :].sum(2), self.kernel, self.pooling)
