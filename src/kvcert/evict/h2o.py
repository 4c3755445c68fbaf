"""H2O: heavy hitters by accumulated attention plus a protected recent window (spec §11.6)."""

from __future__ import annotations

from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState, accumulate_rows


class H2O(EvictionPolicy):
    """``H2O(recent)``: score_i = Σ_s a_{s,i} over every observed query; the ``recent`` newest positions
    are protected, so with budget ``C`` the heavy-hitter part holds ``C − recent`` items.

    Prefill: the same score over all prefill queries (kvpress ``ObservedAttentionPress`` up to its
    per-column normalisation), with the last ``recent`` positions protected.
    """

    def __init__(self, recent: int = 0, sinks: int = 0) -> None:
        super().__init__(sinks=sinks, recent=recent)

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        state.scores = accumulate_rows(state.scores, attn)

    def _prefill_scores(self, layer: int, attn: Tensor | None, positions: Tensor, kappa: Tensor | None) -> Tensor:
        assert attn is not None
        return attn.sum(-2)
