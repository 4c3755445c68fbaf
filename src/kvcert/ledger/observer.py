"""Adapter from the certified cache's events (:mod:`kvcert.cache.events`) to the :class:`Ledger`.

Slot layout of one cache (``B`` rows, ``H`` KV heads): the entry of row ``b``, KV head ``h`` at logical
position ``p`` is ledger slot ``(p·B + b)·H + h`` of ``(pool, layer)``, so each (row, head) stream is a
strided range and a read is one range per (row, head). One ledger call per layer per write/read event.

Reads of positions the cache has not yet encoded (the tokens of the current forward, attended exactly as
in-flight K/V) are not compressed-pool reads; they are counted in ``n_pending_reads``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcert.bounds.eprocess import eprocess_log_factor
from kvcert.cache.events import ReadEvent, WriteEvent
from kvcert.ledger.admission import observed
from kvcert.ledger.ledger import Ledger


class LedgerObserver:
    """A :class:`~kvcert.cache.events.CacheObserver` that records every write and read in ``ledger``.

    Per-row attribution: ``event.rows[b]`` is the owner/reader of row ``b``; ``-1`` fails closed. A rows
    vector whose length does not match the batch falls back to first-row attribution and is counted
    (``uid_group_fallbacks``). Writes of the dithered (Tier-B) key codec are probabilistic events: each
    owner spends one telescoping share per layer write.
    """

    def __init__(self, ledger: Ledger, pool: str = "kv") -> None:
        self.ledger = ledger
        self.pool = pool
        self.batch: int | None = None
        self.heads: int | None = None
        self.high_water: dict[int, np.ndarray] = {}
        self.n_pending_reads = 0
        self.n_repaired_head_reads = 0

    def _shape(self, b: int, h: int) -> tuple[int, int]:
        if self.batch is None:
            self.batch, self.heads = b, h
        if (b, h) != (self.batch, self.heads):
            raise ValueError(
                f"event has batch {b} x {h} KV heads; this observer's cache has {self.batch} x {self.heads}"
            )
        return b, h

    def _owners(self, rows: torch.Tensor, b: int) -> tuple[np.ndarray, bool]:
        r = rows.detach().to("cpu", torch.int64).numpy().reshape(-1)
        if r.size == b:
            return r, False
        if r.size == 0:
            return np.full(b, -1, dtype=np.int64), False
        return np.full(b, r[0], dtype=np.int64), True

    def on_write(self, event: WriteEvent) -> None:
        """Record one layer's write (one ledger call)."""
        comp = event.compressed.detach().to("cpu").numpy()
        b, h, t = comp.shape
        b, h = self._shape(b, h)
        pos = event.positions.detach().to("cpu", torch.int64).numpy()
        if pos.shape != (b, t):
            raise ValueError(f"positions has shape {pos.shape}, expected {(b, t)}")
        owners_row, fallback = self._owners(event.rows, b)
        valid = np.broadcast_to((pos >= 0)[:, None, :], (b, h, t))
        bb = np.arange(b)[:, None, None]
        hh = np.arange(h)[None, :, None]
        slots = (pos[:, None, :] * b + bb) * h + hh
        owners = np.broadcast_to(owners_row[:, None, None], (b, h, t))
        rule = "probabilistic" if event.tier_b else "deterministic"
        factors = None
        if event.witness_mean is not None and event.witness_c is not None:
            w = event.witness.detach().to("cpu", torch.float64).numpy()[valid]
            m = event.witness_mean.detach().to("cpu", torch.float64).numpy()[valid]
            c = event.witness_c.detach().to("cpu", torch.float64).numpy()[valid]
            live = comp[valid] & (c > 0)
            factors = np.full(w.shape, np.nan)
            factors[live] = eprocess_log_factor(w[live], m[live], c[live])
        self.ledger.write(
            self.pool,
            event.layer,
            slots[valid],
            owners[valid],
            observed(comp[valid], factors),
            rule=rule,
            fallback=fallback,
        )
        hw = self.high_water.setdefault(event.layer, np.zeros(b, dtype=np.int64))
        np.maximum(hw, np.where(pos >= 0, pos + 1, 0).max(-1), out=hw)

    def on_read(self, event: ReadEvent) -> None:
        """Record one layer's read (one ledger call); returns nothing, the cache has already served."""
        rep = event.repaired.detach().to("cpu").numpy()
        b, h = self._shape(*rep.shape)
        readers_row, fallback = self._owners(event.rows, b)
        n = event.n_slots.detach().to("cpu", torch.int64).numpy().reshape(-1)
        hw = self.high_water.get(event.layer, np.zeros(b, dtype=np.int64))
        first = int(event.first_slot)                      # > 0 after sliding-window trims
        count_row = np.clip(np.minimum(n, hw - first), 0, None)
        self.n_pending_reads += int((n - count_row).sum()) * h
        self.n_repaired_head_reads += int(rep.sum())
        starts = ((first * b + np.arange(b)[:, None]) * h + np.arange(h)[None, :]).reshape(-1)
        self.ledger.read(
            self.pool,
            event.layer,
            np.repeat(readers_row, h),
            starts,
            np.repeat(count_row, h),
            steps=np.full(b * h, b * h),
            fallback=fallback,
        )
