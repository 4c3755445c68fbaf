"""H2O: heavy hitters by accumulated attention plus a protected recent window (``docs/eviction.md#policies``)."""

from __future__ import annotations

from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState, accumulate_rows
from kvcert.evict.prefill_attention import PrefillAttention, PrefillReads


class H2O(EvictionPolicy):
    """``H2O(recent)``: score_i = Σ_s a_{s,i} over every observed query; the ``recent`` newest positions
    are protected, so with budget ``C`` the heavy-hitter part holds ``C − recent`` items.

    Prefill: ``observed_attention`` — the same sum over the prefill queries divided by the number of queries
    that see each key (``S − i``), as kvpress's ``ObservedAttentionPress``; the last ``recent`` positions
    are protected.
    """

    def __init__(self, recent: int = 0, sinks: int = 0) -> None:
        super().__init__(sinks=sinks, recent=recent)

    @property
    def prefill_reads(self) -> PrefillReads:
        """The column sums over every prefill row."""
        return PrefillReads(column_sums=True)

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        accumulate_rows(state.buffers[0][..., : state.n], attn)

    def _prefill_scores(
        self, layer: int, attn: PrefillAttention | None, positions: Tensor, kappa: Tensor | None
    ) -> Tensor:
        assert attn is not None
        return attn.observed()
