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
from kvcert.ledger.events import Rule
from kvcert.ledger.ledger import Ledger

_RANGE_CACHE = 64  # cached (first slot, counts) read layouts per observer


class LedgerObserver:
    """A :class:`~kvcert.cache.events.CacheObserver` that records every write and read in ``ledger``.

    Per-row attribution: ``event.rows[b]`` is the owner/reader of row ``b``; ``-1`` fails closed. A rows
    vector whose length does not match the batch falls back to first-row attribution and is counted
    (``uid_group_fallbacks``). Writes of the dithered (Tier-B) key codec are probabilistic events: each
    owner spends one telescoping share per layer write. Reads a Tier-B gate served on its partially certified
    bound are charged to their reader's budget (``event.tier_b_cells`` cells at ``event.delta_loc`` each).
    """

    def __init__(self, ledger: Ledger, pool: str = "kv") -> None:
        self.ledger = ledger
        self.pool = pool
        self.batch: int | None = None
        self.heads: int | None = None
        self.high_water: dict[int, list[int]] = {}
        self.n_pending_reads = 0
        self._offsets = np.zeros(0, dtype=np.int64)  # (b·H + h) for every (row, head) stream
        self._steps = np.zeros(0, dtype=np.int64)
        self._no_generation = np.zeros(0, dtype=np.int64)  # reads carry no authorisation-time generation
        # read ranges change only with the rows and with (first slot, per-row counts): cached, read-only
        self._read_rows: list[int] | None = None
        self._readers = np.zeros(0, dtype=np.int64)
        self._read_fallback = False
        self._ranges: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def _shape(self, b: int, h: int) -> tuple[int, int]:
        if self.batch is None:
            self.batch, self.heads = b, h
            self._offsets = _frozen(np.arange(b * h, dtype=np.int64))
            self._steps = _frozen(np.full(b * h, b * h, dtype=np.int64))
            self._no_generation = _frozen(np.full(b * h, -1, dtype=np.int64))
        if (b, h) != (self.batch, self.heads):
            raise ValueError(
                f"event has batch {b} x {h} KV heads; this observer's cache has {self.batch} x {self.heads}"
            )
        return b, h

    @staticmethod
    def _owners(rows: torch.Tensor, b: int) -> tuple[np.ndarray, bool]:
        r = rows.numpy(force=True).astype(np.int64, copy=False).reshape(-1)
        if r.size == b:
            return r, False
        if r.size == 0:
            return np.full(b, -1, dtype=np.int64), False
        return np.full(b, r[0], dtype=np.int64), True

    def on_write(self, event: WriteEvent) -> None:
        """Record one layer's write (one ledger call)."""
        comp = event.compressed.numpy(force=True)
        b, h, t = comp.shape
        b, h = self._shape(b, h)
        pos = event.positions.numpy(force=True).astype(np.int64, copy=False)
        if pos.shape != (b, t):
            raise ValueError(f"positions has shape {pos.shape}, expected {(b, t)}")
        owners_row, fallback = self._owners(event.rows, b)
        slots = pos[:, None, :] * (b * h) + self._offsets.reshape(b, h, 1)
        owners = np.broadcast_to(owners_row[:, None, None], (b, h, t))
        valid = np.broadcast_to((pos >= 0)[:, None, :], (b, h, t))
        everything = bool(valid.all())

        def pick(x: np.ndarray) -> np.ndarray:
            return x.reshape(-1) if everything else x[valid]

        rule: Rule = "probabilistic" if event.tier_b else "deterministic"
        factors = None
        if event.witness_mean is not None and event.witness_c is not None:
            w, m, c = (
                pick(x.numpy(force=True).astype(np.float64))
                for x in (event.witness, event.witness_mean, event.witness_c)
            )
            live = pick(comp) & (c > 0)
            factors = np.full(w.shape, np.nan)
            factors[live] = eprocess_log_factor(w[live], m[live], c[live])
        self.ledger.write(
            self.pool,
            event.layer,
            pick(slots),
            pick(owners),
            observed(pick(comp), factors),
            rule=rule,
            fallback=fallback,
        )
        top = np.where(pos >= 0, pos + 1, 0).max(-1).tolist()
        hw = self.high_water.setdefault(event.layer, [0] * b)
        self.high_water[event.layer] = [max(x, y) for x, y in zip(hw, top, strict=True)]

    def on_read(self, event: ReadEvent) -> None:
        """Record one layer's read (one ledger call); returns nothing, the cache has already served."""
        b, h = self._shape(*event.repaired.shape)
        rows = event.rows.tolist()
        if rows != self._read_rows:  # arrays are rebuilt only when the rows change (never within a batch)
            readers_row, fallback = self._owners(event.rows, b)
            self._read_rows, self._readers, self._read_fallback = rows, _frozen(np.repeat(readers_row, h)), fallback
        n = event.n_slots.tolist()
        first = int(event.first_slot)  # > 0 after sliding-window trims
        hw = self.high_water.get(event.layer, [0] * b)
        count_row = [max(min(x, top - first), 0) for x, top in zip(n, hw, strict=True)]
        self.n_pending_reads += (sum(n) - sum(count_row)) * h
        key = (first, *count_row)
        ranges = self._ranges.get(key)
        if ranges is None:
            if len(self._ranges) >= _RANGE_CACHE:
                self._ranges.clear()
            starts = _frozen(self._offsets + first * b * h)
            ranges = self._ranges[key] = (starts, _frozen(np.repeat(np.array(count_row, dtype=np.int64), h)))
        self.ledger.read(
            self.pool,
            event.layer,
            self._readers,
            ranges[0],
            ranges[1],
            steps=self._steps,
            generations=self._no_generation,
            fallback=self._read_fallback,
        )
        if event.tier_b_cells is not None and event.delta_loc is not None:
            for uid, cells in zip(self._readers[::h].tolist(), event.tier_b_cells.tolist(), strict=True):
                if cells and uid >= 0:  # a row without identity stores nothing compressed: no Tier-B read
                    self.ledger.charge(uid, cells, event.delta_loc)


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only: cached range arrays are shared by many ledger events and must never change."""
    a.flags.writeable = False
    return a
