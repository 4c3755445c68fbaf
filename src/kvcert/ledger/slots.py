"""Slot table: state, owner and generation of every physical entry, keyed by (pool, layer, slot).

State machine (``docs/ledger.md#slots-and-identity``)::

    unwritten --(write, admitted)--> compressed --(audit violation)--> restored_exact
    unwritten --(write, rejected | unattributable | empirical)--> kept_exact
    any --(write: generation + 1, state unwritten, new owner, *before any gate*)--> (re-enter)

A read is served compressed only when the slot is ``compressed`` **and** its generation equals the
generation the reader was authorised against (freshness invariant).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from kvcert.ledger.uids import UNATTRIBUTED

MAX_SLOTS = 1 << 26
"""Slots per ``(pool, layer)`` table: slot ids lie in ``[0, MAX_SLOTS)`` (67,108,864: a 128k-token context
× batch 64 × 8 KV heads in the observer's layout). The table is dense, so the bound caps its memory at
~1.1 GB; a write, read or fault outside it is refused before anything is allocated."""


def check_slot_range(first: int, last: int, what: str) -> None:
    """``ValueError`` unless ``0 <= first`` and ``last < MAX_SLOTS`` (``first``/``last``: smallest/largest id)."""
    if first < 0:
        raise ValueError(f"{what} must be >= 0, got {first}")
    if last >= MAX_SLOTS:
        raise ValueError(f"{what} must be < MAX_SLOTS = {MAX_SLOTS}, got {last}")


class SlotState(IntEnum):
    """Explicit state of one slot."""

    UNWRITTEN = 0
    COMPRESSED = 1
    KEPT_EXACT = 2
    RESTORED_EXACT = 3


@dataclass(frozen=True)
class SlotKey:
    """Full identity of one stored entry: the pool family is part of the key (namespace collisions)."""

    pool: str
    layer: int
    slot: int
    generation: int


class LayerSlots:
    """Dense per-(pool, layer) arrays of state, owner and generation, grown by doubling."""

    def __init__(self, capacity: int = 64) -> None:
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.owner = np.full(capacity, UNATTRIBUTED, dtype=np.int64)
        self.generation = np.zeros(capacity, dtype=np.int64)
        self.version = 0  # bumped by every change (the key of the ledger's read memo)
        self.read_memo: tuple[Any, ...] | None = None

    def _grow(self, need: int) -> None:
        cap = self.state.shape[0]
        if need <= cap:
            return
        new = max(2 * cap, need)
        self.version += 1
        self.state = np.concatenate([self.state, np.zeros(new - cap, dtype=np.uint8)])
        self.owner = np.concatenate([self.owner, np.full(new - cap, UNATTRIBUTED, dtype=np.int64)])
        self.generation = np.concatenate([self.generation, np.zeros(new - cap, dtype=np.int64)])

    def invalidate(self, slots: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """Bump the generation, set the new owner and state ``unwritten`` of the **distinct** ``slots`` (one
        write, validated by :meth:`Ledger.write`); return the previous owners."""
        if slots.size:
            self._grow(int(slots.max()) + 1)
        previous = self.owner[slots]  # fancy indexing: a copy
        self.generation[slots] += 1
        self.state[slots] = SlotState.UNWRITTEN
        self.owner[slots] = owners
        self.version += 1
        return previous

    def set_states(self, slots: np.ndarray, states: np.ndarray) -> None:
        """Set the state of already-invalidated ``slots`` (write outcome, fault restoration)."""
        self.state[slots] = states
        self.version += 1

    def lookup(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(state, owner, generation)`` of ``slots``; slots never written read as unwritten, gen 0."""
        n = self.state.shape[0]
        if slots.size == 0 or int(slots.max()) < n:
            return self.state[slots], self.owner[slots], self.generation[slots]
        inside = slots < n
        idx = np.where(inside, slots, 0)
        state = np.where(inside, self.state[idx], SlotState.UNWRITTEN).astype(np.uint8)
        owner = np.where(inside, self.owner[idx], UNATTRIBUTED)
        gen = np.where(inside, self.generation[idx], 0)
        return state, owner, gen

    def used(self) -> int:
        """One past the highest slot ever written (0 if none)."""
        written = np.flatnonzero(self.generation)
        return int(written[-1]) + 1 if written.size else 0
