"""StreamingLLM: attention sinks plus the most recent window (``docs/eviction.md#policies``)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvcert.evict.base import F64, EvictionPolicy, LayerState
from kvcert.evict.prefill_attention import PrefillAttention


class StreamingLLM(EvictionPolicy):
    """``StreamingLLM(sinks, window)``: keep the ``sinks`` first positions and the newest items.

    Score = logical position (newer is better), sinks protected. With ``window`` set, at most
    ``sinks + window`` items are kept whatever the budget; with ``window=None`` the window is
    ``budget − sinks``. Attention is never read.
    """

    needs_attention = False

    def __init__(self, sinks: int = 4, window: int | None = None) -> None:
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive or None, got {window}")
        super().__init__(sinks=sinks, recent=0)
        self.window = window

    def select(self, layer: int, budget: int, chunk: int = 1) -> Tensor | None:
        """As the base, with ``budget`` (and ``chunk``) capped at ``sinks + window`` when ``window`` is set."""
        cap = budget if self.window is None else min(budget, self.sinks + self.window)
        return super().select(layer, cap, min(chunk, cap))

    def _drop_middle(self, layer: int, state: LayerState, lo: int, hi: int, k: int) -> Tensor:
        # positions increase along the slots: the k oldest unprotected items are the first k of [lo, hi)
        return torch.arange(lo, lo + k, device=state.device).expand(*state.buffers[0].shape[:2], k)

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return state.positions.to(F64)

    def _prefill_scores(
        self, layer: int, attn: PrefillAttention | None, positions: Tensor, kappa: Tensor | None
    ) -> Tensor:
        return positions.to(F64)
