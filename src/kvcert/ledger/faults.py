"""Fault-injection harness over a small ledgered int8 pool (``docs/ledger.md#fault-injection``).

:class:`LedgeredPool` is a minimal compressed pool driven through the :class:`Ledger`: int8 codes and a
per-slot scale (device tier), an exact copy (host tier), a write-time witness ``‖x̂ − x‖`` with a
deterministic admission rule, a per-slot code checksum verified on every compressed read, and the
allocator's source generation per slot (the freshness premise). The four injectors bypass the certified
writer exactly as the real bugs did; each must be detected, located at ``(pool, layer, slot, generation,
owner)`` and counted, and no read may serve changed data without a counter moving.
"""

from __future__ import annotations

import numpy as np

from kvcert.ledger.admission import deterministic
from kvcert.ledger.ledger import Incident, Ledger
from kvcert.ledger.slots import SlotState

_WEIGHTS_MOD = 2_147_483_647


def _checksum(codes: np.ndarray) -> np.ndarray:
    """Position-weighted sum of the codes of each row, mod a prime (any single-code change is caught)."""
    w = np.arange(1, codes.shape[-1] + 1, dtype=np.int64)
    return (codes.astype(np.int64) * w).sum(-1) % _WEIGHTS_MOD


class LedgeredPool:
    """``capacity`` slots of ``dim`` floats in ledger namespace ``name`` at ``layer``."""

    def __init__(self, ledger: Ledger, name: str, layer: int, capacity: int, dim: int, threshold: float) -> None:
        if capacity < 1 or dim < 1:
            raise ValueError(f"capacity and dim must be >= 1, got {capacity}, {dim}")
        self.ledger = ledger
        self.name = name
        self.layer = layer
        self.threshold = threshold
        self.codes = np.zeros((capacity, dim), dtype=np.int8)
        self.scale = np.ones(capacity)
        self.check = np.zeros(capacity, dtype=np.int64)
        self.witness = np.zeros(capacity)
        self.host = np.zeros((capacity, dim))
        self.src_gen = np.zeros(capacity, dtype=np.int64)

    def write(self, slots: np.ndarray, owners: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Certified write: ledger invalidation + deterministic ``‖x̂ − x‖ ≤ threshold`` admission."""
        scale = np.maximum(np.abs(x).max(-1), 1e-12) / 127.0
        codes = np.clip(np.round(x / scale[:, None]), -127, 127).astype(np.int8)
        w = np.linalg.norm(codes * scale[:, None] - x, axis=-1)
        states = self.ledger.write(self.name, self.layer, slots, owners, deterministic(w, self.threshold))
        self.host[slots] = x
        self.codes[slots], self.scale[slots], self.witness[slots] = codes, scale, w
        self.check[slots] = _checksum(codes)
        self.src_gen[slots] = self.ledger.lookup(self.name, self.layer, slots)[2]
        return states

    def read(self, reader: int, slots: np.ndarray) -> np.ndarray:
        """Serve ``slots`` for ``reader``: compressed only if the ledger allows it and the checksum holds."""
        slots = np.asarray(slots, dtype=np.int64)
        ok = self.ledger.read(
            self.name,
            self.layer,
            np.full(slots.size, reader),
            slots,
            np.ones(slots.size),
            generations=self.src_gen[slots],
        )
        bad = ok & (_checksum(self.codes[slots]) != self.check[slots])
        for s in slots[bad]:
            self.ledger.report_fault("corrupt_code", self.name, self.layer, int(s), "checksum on read")
        ok &= ~bad
        decoded = self.codes[slots] * self.scale[slots, None]
        return np.where(ok[:, None], decoded, self.host[slots])

    def written(self) -> np.ndarray:
        """Slots currently in the ``compressed`` state (the sentinel's population)."""
        every = np.arange(self.codes.shape[0])
        return every[self.ledger.lookup(self.name, self.layer, every)[0] == SlotState.COMPRESSED]

    def verify(self, slots: np.ndarray) -> np.ndarray:
        """Host-tier check: ``‖decode(codes) − host‖ > witness`` (the write-time bound) marks a bad slot."""
        err = np.linalg.norm(self.codes[slots] * self.scale[slots, None] - self.host[slots], axis=-1)
        return err > self.witness[slots] * (1 + 1e-9) + 1e-12


# ------------------------------------------------------------------------------------------ injectors
def corrupt_codes(pool: LedgeredPool, slot: int, rng: np.random.Generator) -> None:
    """Fault 1: change one stored code of ``slot`` behind the ledger's back (device-memory corruption)."""
    j = int(rng.integers(0, pool.codes.shape[1]))
    pool.codes[slot, j] = np.int8(-int(pool.codes[slot, j]) if pool.codes[slot, j] != 0 else 100)


def reuse_without_invalidation(pool: LedgeredPool, slot: int, x: np.ndarray) -> None:
    """Fault 2: the allocator hands ``slot`` to a new request and writes the source, but the certified
    writer is bypassed (no invalidation): the packed codes stay those of the previous generation."""
    pool.host[slot] = x
    pool.src_gen[slot] += 1


def collide_namespaces(
    ledger: Ledger, name: str, layer: int, capacity: int, dim: int, threshold: float
) -> tuple[LedgeredPool, LedgeredPool]:
    """Fault 3: two pool families (e.g. key pages and index pages) registered under one ledger namespace."""
    return (
        LedgeredPool(ledger, name, layer, capacity, dim, threshold),
        LedgeredPool(ledger, name, layer, capacity, dim, threshold),
    )


def drop_identity(pool: LedgeredPool, slots: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Fault 4: a write whose request identity was lost (owner -1); the ledger must fail closed."""
    return pool.write(slots, np.full(slots.size, -1), x)


def locate(ledger: Ledger, kind: str, pool: str, layer: int, slot: int) -> Incident | None:
    """The first recorded incident of ``kind`` at ``(pool, layer, slot)``, or None."""
    for inc in ledger.incidents:
        if inc.kind == kind and inc.pool == pool and inc.layer == layer and inc.slot == slot:
            return inc
    return None
