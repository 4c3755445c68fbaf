"""Ledger events: the only way the ledger state changes; the log stores them and replay re-applies them.

Every event records *outcomes* (final slot states, realised e-process factors), never randomness to be
redrawn, so applying the same events in the same order rebuilds the same state field for field.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Literal, cast

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


@dataclass(frozen=True)
class BudgetCharge:
    """``cells`` reads of request ``uid`` served on a partially certified bound, each failing with probability at
    most ``delta_loc`` (a Tier-B gate): the request's budget spends ``cells · delta_loc``."""

    uid: int
    cells: int
    delta_loc: float


Event = OpenRequest | SlotWrite | SlotRead | FaultReport | BudgetCharge
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
    if isinstance(event, BudgetCharge):
        return "charge", json.dumps([event.uid, event.cells, event.delta_loc]), None, None, None, None
    raise TypeError(f"not a ledger event: {type(event).__name__}")


class LogError(ValueError):
    """A ledger log that cannot be trusted as evidence: malformed (missing fields, wrong types, truncated
    arrays), tampered (broken hash chain, gap or reorder in the sequence numbers) or holding an event the
    live API would have refused. The message is one line and names the first bad sequence number."""


_META_TYPES: dict[str, tuple[type, ...]] = {
    "open": (int, float),
    "write": (str, int, str, bool),
    "read": (str, int, bool, bool),
    "fault": (str, str, int, int, str),
    "charge": (int, int, float),
}


def _array(blob: object, dtype: type, what: str) -> np.ndarray:
    if not isinstance(blob, bytes):
        raise LogError(f"{what}: expected a byte array, got {type(blob).__name__}")
    size = np.dtype(dtype).itemsize
    if len(blob) % size:
        raise LogError(f"{what}: {len(blob)} bytes is not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(blob, dtype)


def _meta_fields(kind: str, meta: object) -> tuple[object, ...]:
    """The JSON header of a row, type-checked against its kind (``bool`` is not an ``int`` here)."""
    if not isinstance(meta, str):
        raise LogError(f"{kind} header: expected JSON text, got {type(meta).__name__}")
    return _parse_meta(kind, meta)


@functools.lru_cache(maxsize=4096)
def _parse_meta(kind: str, meta: str) -> tuple[object, ...]:
    """:func:`_meta_fields` of text (memoised: a log repeats the same few headers)."""
    try:
        m = json.loads(meta)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise LogError(f"{kind} header is not valid JSON: {str(exc)[:80]}") from None
    types = _META_TYPES[kind]
    if not isinstance(m, list) or len(m) != len(types):
        raise LogError(f"{kind} header: expected a list of {len(types)} fields, got {meta[:80]!r}")
    for i, (value, want) in enumerate(zip(m, types, strict=True)):
        ok = isinstance(value, int | float) if want is float else isinstance(value, want)
        if want is not bool and isinstance(value, bool):
            ok = False
        if not ok:
            raise LogError(f"{kind} header field {i}: expected {want.__name__}, got {value!r}")
    return tuple(m)


def decode(row: Row) -> Event:
    """Inverse of :func:`encode`; :class:`LogError` naming the problem for a row of the wrong shape (unknown
    kind, header of the wrong type or length, arrays of mismatched lengths)."""
    if not isinstance(row, tuple) or len(row) != 6:
        raise LogError("a log row must hold kind, header and four arrays")
    kind, meta, a, b, c, d = row
    if kind not in _META_TYPES:
        raise LogError(f"unknown event kind in log: {kind!r}")
    m = _meta_fields(kind, meta)
    if kind == "open":
        return OpenRequest(int(cast(int, m[0])), float(cast(float, m[1])))  # header types checked above
    if kind == "write":
        if m[2] not in RULES:
            raise LogError(f"write rule must be one of {RULES}, got {m[2]!r}")
        slots, owners = _array(a, np.int64, "write slots"), _array(b, np.int64, "write owners")
        states, factors = _array(c, np.uint8, "write states"), _array(d, np.float64, "write factors")
        if not slots.size == owners.size == states.size == factors.size:
            raise LogError(
                f"write arrays differ in length: slots {slots.size}, owners {owners.size}, states {states.size}, "
                f"factors {factors.size}"
            )
        return SlotWrite(m[0], m[1], slots, owners, states, m[2], factors, m[3])  # type: ignore[arg-type]
    if kind == "read":
        ranges, gens = _array(a, np.int64, "read ranges"), _array(b, np.int64, "read generations")
        if ranges.size != 4 * gens.size:
            raise LogError(f"read arrays differ in length: {ranges.size} range values for {gens.size} ranges")
        r = ranges.reshape(4, -1)
        return SlotRead(m[0], m[1], r[0], r[1], r[2], r[3], gens, m[2], m[3])  # type: ignore[arg-type]
    if kind == "charge":
        return BudgetCharge(int(cast(int, m[0])), int(cast(int, m[1])), float(cast(float, m[2])))
    return FaultReport(m[0], m[1], m[2], m[3], m[4])  # type: ignore[arg-type]
