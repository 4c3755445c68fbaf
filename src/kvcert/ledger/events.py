"""Ledger events: the only way the ledger state changes; the log stores them and replay re-applies them.

Every event records *outcomes* (final slot states, realised e-process factors), never randomness to be
redrawn, so applying the same events in the same order rebuilds the same state field for field.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Literal

import numpy as np

Rule = Literal["deterministic", "probabilistic", "empirical"]
RULES: tuple[Rule, ...] = ("deterministic", "probabilistic", "empirical")


@dataclass(frozen=True)
class OpenRequest:
    """A new request account with its own budget ``delta_req``."""

    uid: int
    delta_req: float


@dataclass(frozen=True)
class SlotWrite:
    """One write call: ``slots[N]`` of ``(pool, layer)`` written by ``owners[N]`` with final ``states[N]``.

    ``log_factors[N]`` holds the e-process factor of each authorised probabilistic entry (NaN elsewhere);
    ``fallback`` marks a write whose per-row attribution used the first-row fallback.
    """

    pool: str
    layer: int
    slots: np.ndarray
    owners: np.ndarray
    states: np.ndarray
    rule: Rule
    log_factors: np.ndarray
    fallback: bool = False


@dataclass(frozen=True)
class SlotRead:
    """Strided slot ranges of ``(pool, layer)`` read in one call.

    Range ``i`` is read by ``readers[i]`` and covers slots ``starts[i] + steps[i]·j`` for
    ``j < counts[i]``, each expected at generation ``generations[i]`` (-1: no expectation, i.e. the reader
    holds no authorisation-time generation). ``shared`` declares prefix sharing: foreign-owned entries are
    then legitimate and attributed to their owner. ``fallback`` marks first-row attribution.
    """

    pool: str
    layer: int
    readers: np.ndarray
    starts: np.ndarray
    steps: np.ndarray
    counts: np.ndarray
    generations: np.ndarray
    shared: bool = False
    fallback: bool = False

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-entry ``(readers, slots, generations)`` arrays."""
        counts = self.counts.astype(np.int64)
        total = int(counts.sum())
        rng = np.repeat(np.arange(counts.size), counts)
        offset = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        slots = self.starts[rng] + self.steps[rng] * offset
        return self.readers[rng], slots, self.generations[rng]


@dataclass(frozen=True)
class FaultReport:
    """A detected fault at ``(pool, layer, slot)``; the slot is served exact from the host tier afterwards."""

    kind: str
    pool: str
    layer: int
    slot: int
    detail: str = ""


Event = OpenRequest | SlotWrite | SlotRead | FaultReport
Row = tuple[str, str, bytes | None, bytes | None, bytes | None, bytes | None]


@functools.lru_cache(maxsize=4096)
def _meta(*fields: str | int | bool) -> str:
    """JSON of a read's header fields (memoised: a decode step repeats the same few headers)."""
    return json.dumps(list(fields))


def read_blobs(event: SlotRead) -> tuple[bytes, ...]:
    """The int64 bytes of a read's ``readers, starts, steps, counts, generations`` (also the ledger's memo key)."""
    arrays = (event.readers, event.starts, event.steps, event.counts, event.generations)
    return tuple(np.asarray(a, dtype=np.int64).tobytes() for a in arrays)


def read_row(event: SlotRead, blobs: tuple[bytes, ...]) -> Row:
    """The log row of a read from its :func:`read_blobs`: the four range arrays back to back (the layout of
    a ``[4, R]`` array), then the generations."""
    meta = _meta(event.pool, event.layer, event.shared, event.fallback)
    return "read", meta, b"".join(blobs[:4]), blobs[4], None, None


def encode(event: Event) -> Row:
    """``(kind, meta-json, blob×4)`` row for the SQLite log."""
    if isinstance(event, OpenRequest):
        return "open", json.dumps([event.uid, event.delta_req]), None, None, None, None
    if isinstance(event, SlotWrite):
        meta = json.dumps([event.pool, event.layer, event.rule, event.fallback])
        return (
            "write",
            meta,
            event.slots.astype(np.int64).tobytes(),
            event.owners.astype(np.int64).tobytes(),
            event.states.astype(np.uint8).tobytes(),
            event.log_factors.astype(np.float64).tobytes(),
        )
    if isinstance(event, SlotRead):
        return read_row(event, read_blobs(event))
    if isinstance(event, FaultReport):
        meta = json.dumps([event.kind, event.pool, event.layer, event.slot, event.detail])
        return "fault", meta, None, None, None, None
    raise TypeError(f"not a ledger event: {type(event).__name__}")


def decode(row: Row) -> Event:
    """Inverse of :func:`encode`."""
    kind, meta, a, b, c, d = row
    m = json.loads(meta)
    if kind == "open":
        return OpenRequest(int(m[0]), float(m[1]))
    if kind == "write":
        return SlotWrite(
            m[0],
            int(m[1]),
            np.frombuffer(a, np.int64),
            np.frombuffer(b, np.int64),
            np.frombuffer(c, np.uint8),
            m[2],
            np.frombuffer(d, np.float64),
            bool(m[3]),
        )
    if kind == "read":
        r = np.frombuffer(a, np.int64).reshape(4, -1)
        return SlotRead(m[0], int(m[1]), r[0], r[1], r[2], r[3], np.frombuffer(b, np.int64), bool(m[2]), bool(m[3]))
    if kind == "fault":
        return FaultReport(m[0], m[1], int(m[2]), int(m[3]), m[4])
    raise ValueError(f"unknown event kind in log: {kind!r}")
