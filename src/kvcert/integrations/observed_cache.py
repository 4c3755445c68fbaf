"""transformers' exact ``DynamicCache`` that reports its writes and reads to cache observers (the risk ledger).

The exact baseline beside :class:`~kvcert.integrations.transformers.CertifiedCache`: the same write and read events,
every entry exact. The batching server (:mod:`kvcert.serving.server`) uses it for its ``dynamic_cache()`` factory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from kvcert.cache.events import CacheObserver, ReadEvent, WriteEvent

__all__ = ["ObservedDynamicCache"]


class ObservedDynamicCache(DynamicCache):
    """transformers' exact ``DynamicCache`` that reports its writes and reads to cache observers.

    Every entry is stored exact, so every write event says ``compressed = False`` (witness 0); the events
    carry the per-row request UIDs exactly as the certified cache's do. Used to drive the ledger when the
    certified cache is not wanted (baselines, attribution tests).
    """

    def __init__(self, rows: torch.Tensor, observers: Sequence[CacheObserver]) -> None:
        super().__init__()
        self.rows = rows
        self.observers = list(observers)
        self._step = -1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store exactly, then emit the write event and the read event of this layer."""
        before = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == 0:
            self._step += 1
        b, h, t, _ = key_states.shape
        dev = key_states.device
        zeros = torch.zeros((b, h, t), device=dev)
        write = WriteEvent(
            layer=layer_idx,
            rows=self.rows,
            positions=torch.arange(before, before + t, device=dev).expand(b, t),
            compressed=torch.zeros((b, h, t), dtype=torch.bool, device=dev),
            witness=zeros,
            value_witness=zeros,
            codec="exact",
            tier_b=False,
        )
        read = ReadEvent(
            layer=layer_idx,
            step=self._step,
            rows=self.rows,
            n_slots=torch.full((b,), before + t, device=dev),
            certificate=torch.zeros((b, h), device=dev),
            repaired=torch.zeros((b, h), dtype=torch.bool, device=dev),
        )
        for obs in self.observers:
            obs.on_write(write)
            obs.on_read(read)
        return k, v
