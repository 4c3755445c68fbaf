"""The request-level risk ledger: accounts, slots, budgets, e-processes and incidents (``docs/ledger.md``).

Every state change is an event (:mod:`kvcert.ledger.events`) applied by one function, live or in replay,
so a ledger rebuilt from its log equals the live ledger field for field. Public methods are thread-safe.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcert.bounds.eprocess import alarm_threshold
from kvcert.ledger.admission import Decide, Decision
from kvcert.ledger.events import (
    RULES,
    BudgetCharge,
    Event,
    FaultReport,
    OpenRequest,
    Rule,
    SlotRead,
    SlotWrite,
    read_blobs,
    read_row,
)
from kvcert.ledger.log import EventLog, read_events
from kvcert.ledger.request_budget import RequestBudget
from kvcert.ledger.running_eprocess import EProcess
from kvcert.ledger.slots import MAX_SLOTS, LayerSlots, SlotKey, SlotState, check_slot_range
from kvcert.ledger.uids import UNATTRIBUTED, UidAllocator

_COUNTERS = (
    "n_written",
    "n_compressed",
    "n_kept_exact",
    "n_restored_exact",
    "n_authorized",
    "n_auth_violations",
    "n_prob_events",
    "n_empirical",
    "n_reads",
    "n_read_compressed",
    "n_read_exact",
    "n_read_unwritten",
    "n_read_stale",
    "n_read_foreign_owner",
    "n_read_shared",
    "n_read_by_others",
)
# plain ints for the replay hot path (IntEnum attribute access is slow)
_UNWRITTEN, _COMPRESSED, _KEPT, _RESTORED = (int(x) for x in SlotState)


def _distinct(values: np.ndarray) -> list[int]:
    """Distinct values in ascending order (Python's set beats ``np.unique``'s fixed cost on small arrays)."""
    if values.size == 0:
        return []
    if values.size <= 4096:
        return sorted(set(values.tolist()))
    return [int(v) for v in np.unique(values)]


def _read_key(table: LayerSlots, ev: SlotRead) -> tuple[Any, ...]:
    """Identity of a read's content at the table's current version (the read memo's key): the version, then
    the read's :func:`~kvcert.ledger.events.read_blobs`."""
    return (table.version, *read_blobs(ev))


def _int64(a: np.ndarray) -> np.ndarray:
    """``a`` as a flat int64 array (no numpy call when it already is one: the observer's hot path)."""
    if type(a) is np.ndarray and a.ndim == 1 and a.dtype == np.int64:
        return a
    return np.asarray(a, dtype=np.int64).reshape(-1)


def _groups(values: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Distinct values (ascending) and each entry's index into them."""
    uniq = _distinct(values)
    if len(uniq) == 1:  # the common single-owner call
        return uniq, np.zeros(values.size, dtype=np.intp)
    return uniq, np.searchsorted(uniq, values)


@dataclass
class Account:
    """One request's account: its own telescoping budget, e-process and write/read counters."""

    uid: int
    budget: RequestBudget
    eprocess: EProcess
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``delta_spent`` rounded up; ``delta_spent_exact`` as ``p/q``)."""
        return {
            "uid": self.uid,
            "delta_req": self.budget.delta_req,
            "k": self.budget.k,
            "delta_spent": self.budget.spent_upper,
            "delta_spent_exact": str(self.budget.spent),
            "tier_b_cells": self.budget.charged_cells,
            **self.counts,
            "eprocess": self.eprocess.to_dict(),
        }


@dataclass(frozen=True)
class Incident:
    """One located event: which (pool, layer, slot, generation) it hit, its owner and the reader (if any)."""

    kind: str
    pool: str
    layer: int
    slot: int
    generation: int
    owner: int
    reader: int = UNATTRIBUTED

    @property
    def key(self) -> SlotKey:
        """The slot identity the incident is attributed to."""
        return SlotKey(self.pool, self.layer, self.slot, self.generation)


class Ledger:
    """Request accounts and slot table fed by writes and reads; optionally persisted to an :class:`EventLog`.

    Args:
        delta_req: each request's failure budget (telescoping, per account).
        delta_e: the e-process model-validation budget (alarm at ``log M ≥ ln(1/δ_e)``).
        log: event log every event is appended to *before* it is applied (committed at once by a
            synchronous log; by the next group commit of a background log, durable after :meth:`flush`).
            A log opened with ``EventLog(path, resume=True)`` that already holds events is **continued**:
            the ledger first re-applies (and validates) them, so accounts, slots and request ids carry on
            where the earlier run stopped; its configuration must equal the one stored in the log.
        model: label for metrics.
        max_incidents: located incidents kept per kind (all are counted).
        rank / n_ranks: this ledger's replica rank and the declared number of replicas (tensor-parallel
            ranks each keep their own ledger of the same logical events; :mod:`kvcert.serving.replicas`).
    """

    def __init__(
        self,
        delta_req: float = 0.01,
        delta_e: float = 0.01,
        log: EventLog | None = None,
        model: str = "model",
        max_incidents: int = 256,
        rank: int = 0,
        n_ranks: int = 1,
    ) -> None:
        RequestBudget(delta_req)  # validates delta_req
        alarm_threshold(delta_e)  # validates delta_e
        if max_incidents < 0:
            raise ValueError(f"max_incidents must be >= 0, got {max_incidents}")
        if not 0 <= rank < n_ranks:
            raise ValueError(f"rank must lie in [0, n_ranks), got rank {rank} of {n_ranks}")
        self.rank = int(rank)
        self.n_ranks = int(n_ranks)
        self.delta_req = float(delta_req)
        self.delta_e = float(delta_e)
        self.model = model
        self.log = log
        self.max_incidents = max_incidents
        self.uids = UidAllocator()
        self.accounts: dict[int, Account] = {}
        self.eprocess = EProcess(delta_e)
        self.tables: dict[tuple[str, int], LayerSlots] = {}
        self.counters: Counter[str] = Counter(
            dict.fromkeys(
                ("identity_fail_closed", "identity_fail_closed_reads", "uid_group_fallbacks", "n_slot_reuse"),
                0,
            )
        )
        self.incidents: list[Incident] = []
        self._incident_counts: Counter[str] = Counter()
        self._incidents_kept: Counter[str] = Counter()
        self._last_incident: dict[str, Incident] = {}
        self._lock = threading.RLock()
        if log is not None:
            log.set_meta(  # refuses a resumed log whose stored configuration differs
                {
                    "delta_req": self.delta_req,
                    "delta_e": self.delta_e,
                    "model": model,
                    "max_incidents": max_incidents,
                    "rank": self.rank,
                    "n_ranks": self.n_ranks,
                }
            )
            if log.head[0]:  # a resumed log: continue its accounts, slots and request ids
                for event in read_events(log.path):
                    self.apply(event)

    # ------------------------------------------------------------------------------------- public API
    def open_request(self, delta_req: float | None = None) -> int:
        """Allocate a fresh (never reused) UID and open its account; returns the UID."""
        with self._lock:
            d = self.delta_req if delta_req is None else float(delta_req)
            RequestBudget(d)
            uid = self.uids.allocate()
            self._commit(OpenRequest(uid, d))
            return uid

    def write(
        self,
        pool: str,
        layer: int,
        slots: np.ndarray,
        owners: np.ndarray,
        decide: Decide,
        rule: Rule = "deterministic",
        fallback: bool = False,
    ) -> np.ndarray:
        """Write ``slots`` of ``(pool, layer)`` for ``owners`` (per entry; -1 = unattributable).

        Order (invalidate-at-write): every slot gets generation + 1, the new owner and state ``unwritten``
        **before** ``decide(shares, owners)`` runs. Unattributable entries and empirical rules are forced
        exact and spend nothing; a probabilistic rule spends one telescoping share per owner per call.
        If ``decide`` raises, the slots stay ``unwritten`` (never served compressed). Returns final states.
        """
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        slots_a, owners_a = self._check_entries(slots, owners)
        with self._lock:
            owner_ids = _distinct(owners_a[owners_a >= 0])
            for uid in owner_ids:
                self._account(uid)
            table = self._table(pool, layer)
            previous = table.invalidate(slots_a, owners_a)
            shares = np.zeros(slots_a.size)
            if rule == "probabilistic" and owner_ids:
                per_owner = np.array([self.accounts[uid].budget.next_share() for uid in owner_ids])
                valid = owners_a >= 0
                shares[valid] = per_owner[np.searchsorted(owner_ids, owners_a[valid])]
            nan = np.full(slots_a.size, np.nan)
            try:
                decision = (
                    decide(shares, owners_a)
                    if rule != "empirical"
                    else Decision(np.full(slots_a.size, SlotState.KEPT_EXACT, dtype=np.uint8), nan)
                )
                states = self._enforce(decision, owners_a, rule)
                factors = np.where(states == _KEPT, np.nan, decision.log_factors)
                if np.isinf(factors).any():
                    raise ValueError("log_factors must be finite (NaN where no draw happened)")
            except BaseException:  # the slots stay unwritten (never served compressed), also in the log
                unwritten = np.full(slots_a.size, SlotState.UNWRITTEN, dtype=np.uint8)
                self._commit(
                    SlotWrite(pool, layer, slots_a, owners_a, unwritten, "deterministic", nan, fallback),
                    previous,
                )
                raise
            self._commit(SlotWrite(pool, layer, slots_a, owners_a, states, rule, factors, fallback), previous)
            return states

    def read(
        self,
        pool: str,
        layer: int,
        readers: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        steps: np.ndarray | None = None,
        generations: np.ndarray | None = None,
        shared: bool = False,
        fallback: bool = False,
    ) -> np.ndarray:
        """Record reads of strided slot ranges (see :class:`SlotRead`); returns the per-entry mask of reads
        that may be served compressed (``compressed`` state and matching generation). Every other read is
        served exact; unwritten, stale and foreign reads are counted and located."""
        r = _int64(readers)
        n = r.size
        st = _int64(starts)
        ct = _int64(counts)
        sp = np.ones(n, dtype=np.int64) if steps is None else _int64(steps)
        gen = np.full(n, -1, dtype=np.int64) if generations is None else _int64(generations)
        for name, a in (("starts", st), ("counts", ct), ("steps", sp), ("generations", gen)):
            if a.size != n:
                raise ValueError(f"{name} has {a.size} entries, readers has {n}")
        ev = SlotRead(pool, layer, r, st, sp, ct, gen, shared, fallback)
        with self._lock:
            table = self._table(pool, layer)
            key = _read_key(table, ev)
            if table.read_memo is None or table.read_memo[0] != key:  # else: this exact read passed before
                self._check_read(ev)
            if self.log is not None:
                self.log.append_rows([read_row(ev, key[1:])])  # the memo key already holds the bytes
            return self._apply_read(ev, key)

    def charge(self, uid: int, cells: int, delta_loc: float) -> None:
        """Charge request ``uid`` for ``cells`` reads served on a partially certified bound at ``delta_loc`` each
        (:class:`BudgetCharge`; ``ValueError`` for an unknown request, negative cells or ``delta_loc`` outside
        ``(0, 1]``)."""
        event = BudgetCharge(int(uid), int(cells), float(delta_loc))
        with self._lock:
            self.check_event(event)
            self._commit(event)

    def report_fault(self, kind: str, pool: str, layer: int, slot: int, detail: str = "") -> Incident:
        """Record a detected fault at ``(pool, layer, slot)``; a compressed slot turns ``restored_exact``."""
        check_slot_range(int(slot), int(slot), "fault slot")
        with self._lock:
            self._commit(FaultReport(kind, pool, layer, int(slot), detail))
            return self._last_incident[kind]

    def lookup(self, pool: str, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised ``(state, owner, generation)`` of ``slots`` (never-written slots: unwritten, gen 0)."""
        with self._lock:
            s, o, g = self._table(pool, layer).lookup(np.asarray(slots, dtype=np.int64))
            return s.copy(), o.copy(), g.copy()

    def slot_key(self, pool: str, layer: int, slot: int) -> SlotKey:
        """Current identity (with generation) of one slot."""
        with self._lock:
            _, _, gen = self._table(pool, layer).lookup(np.array([slot], dtype=np.int64))
            return SlotKey(pool, layer, int(slot), int(gen[0]))

    def slot_state(self, pool: str, layer: int, slot: int) -> tuple[SlotState, int, int]:
        """``(state, owner, generation)`` of one slot."""
        with self._lock:
            s, o, g = self._table(pool, layer).lookup(np.array([slot], dtype=np.int64))
            return SlotState(int(s[0])), int(o[0]), int(g[0])

    def apply(self, event: Event) -> None:
        """Apply one already-committed event (replay) after checking it against the invariants the live API
        enforces (:meth:`check_event`); ``ValueError`` naming the violation, the state unchanged."""
        with self._lock:
            self.check_event(event)
            self._apply(event, None)

    def check_event(self, event: Event) -> None:
        """``ValueError`` unless ``event`` is one the live API could have logged in the current state:

        * ``OpenRequest``: a valid ``delta_req`` and a UID above every UID opened so far (UIDs are
          allocated strictly increasing and never reused: a repeated or out-of-order open is refused);
        * ``SlotWrite``: slots distinct and in ``[0, MAX_SLOTS)``; owners either unattributed (< 0, then
          ``kept_exact``) or open accounts; states as :meth:`write` leaves them — all ``unwritten`` only for
          a failed gate (logged as deterministic, no factors), otherwise compressed / kept / restored with
          ``restored_exact`` only under the probabilistic rule and only ``kept_exact`` under the empirical
          one; no infinite e-process factor and none on a ``kept_exact`` entry;
        * ``SlotRead``: the checks of :meth:`read` (ranges non-negative and inside ``[0, MAX_SLOTS)``,
          at most ``MAX_SLOTS`` entries, readers unattributed or open accounts);
        * ``FaultReport``: a slot in ``[0, MAX_SLOTS)``; every event but the next: a non-empty pool and a layer >= 0;
        * ``BudgetCharge``: an open account, ``cells >= 0`` and ``delta_loc`` in ``(0, 1]``.
        """
        if isinstance(event, OpenRequest):
            RequestBudget(event.delta_req)
            if event.uid < self.uids.next_uid:
                what = "opened again" if event.uid in self.accounts else "out of order"
                raise ValueError(f"request UID {event.uid} {what} (UIDs are allocated from {self.uids.next_uid})")
            return
        if isinstance(event, BudgetCharge):
            if event.uid not in self.accounts:
                raise ValueError(f"budget charge for request UID {event.uid}, which has no open account")
            RequestBudget(1.0).charge(event.cells, event.delta_loc)  # validates cells and delta_loc
            return
        if isinstance(event, SlotWrite):
            self._check_write_event(event)
        elif isinstance(event, SlotRead):
            self._check_read(event)
        elif isinstance(event, FaultReport):
            check_slot_range(event.slot, event.slot, "fault slot")
        else:
            raise TypeError(f"not a ledger event: {type(event).__name__}")
        self._table(event.pool, event.layer)  # pool and layer

    def _check_write_event(self, ev: SlotWrite) -> None:
        if ev.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {ev.rule!r}")
        slots, owners = self._check_entries(ev.slots, ev.owners)
        states, factors = np.asarray(ev.states), np.asarray(ev.log_factors, dtype=np.float64)
        if states.shape != slots.shape or factors.shape != slots.shape:
            raise ValueError(f"write has {slots.size} slots but {states.size} states and {factors.size} factors")
        for uid in _distinct(owners):
            if uid >= 0:
                self._account(uid)
        if states.size == 0:
            return
        per_state = np.bincount(states, minlength=4)  # one pass: unwritten, compressed, kept, restored, unknown…
        if per_state.size > 4:
            raise ValueError(f"unknown slot state {per_state.size - 1}")
        n_unwritten, _, n_kept, n_restored = per_state.tolist()
        if n_unwritten:
            if n_unwritten != states.size or ev.rule != "deterministic" or not np.isnan(factors).all():
                raise ValueError("state unwritten is only logged for a whole failed write (deterministic, no factors)")
            return
        if ev.rule != "probabilistic" and n_restored:
            raise ValueError(f"state restored_exact inside a {ev.rule} write (needs an audited probabilistic draw)")
        if ev.rule == "empirical" and n_kept != states.size:
            raise ValueError("an empirical write keeps every entry exact")
        if n_kept != states.size and int(owners.min()) < 0 and ((owners < 0) & (states != _KEPT)).any():
            raise ValueError("an unattributed entry (owner < 0) must be kept exact (fail closed)")
        if np.isinf(factors).any() or (n_kept and not np.isnan(factors[states == _KEPT]).all()):
            raise ValueError("e-process factors must be finite, and NaN on kept_exact entries")

    def _check_read(self, ev: SlotRead) -> None:
        """The checks :meth:`read` applies to a read it has not seen before (see :meth:`check_event`)."""
        n = ev.readers.size
        arrays = (("starts", ev.starts), ("counts", ev.counts), ("steps", ev.steps), ("generations", ev.generations))
        for name, a in arrays:
            if a.size != n:
                raise ValueError(f"{name} has {a.size} entries, readers has {n}")
        if not n:
            return
        if n <= 64:  # the common few ranges: Python ints beat a dozen numpy calls (and cannot overflow)
            starts, counts, steps = ev.starts.tolist(), ev.counts.tolist(), ev.steps.tolist()
            if min(min(starts), min(counts), min(steps)) < 0:
                raise ValueError("starts, counts and steps must be >= 0")
            last = max(a + b * max(c - 1, 0) for a, b, c in zip(starts, steps, counts, strict=True))
            total = sum(counts)
        else:
            ranges = np.stack((ev.starts, ev.counts, ev.steps))
            if int(ranges.min()) < 0:
                raise ValueError("starts, counts and steps must be >= 0")
            top = int(ranges.max())
            if top > MAX_SLOTS:  # keeps the product below from overflowing int64
                raise ValueError(f"read slot must be < MAX_SLOTS = {MAX_SLOTS}, got a range value {top}")
            last = int((ev.starts + ev.steps * np.maximum(ev.counts - 1, 0)).max())
            total = int(ev.counts.sum())
        check_slot_range(0, last, "read slot")
        if total > MAX_SLOTS:
            raise ValueError(f"a read covers {total} entries, more than MAX_SLOTS = {MAX_SLOTS}")
        for uid in set(ev.readers.tolist()):
            if uid >= 0:
                self._account(uid)

    # ------------------------------------------------------------------------------------- snapshot
    def snapshot(self) -> dict[str, Any]:
        """The full state as JSON-able data: accounts, global counters, e-process, slots, incidents."""
        with self._lock:
            slots = {}
            for (pool, layer), t in sorted(self.tables.items()):
                used = t.used()
                slots[f"{pool}|{layer}"] = {
                    "state": t.state[:used].tolist(),
                    "owner": t.owner[:used].tolist(),
                    "generation": t.generation[:used].tolist(),
                }
            return {
                "model": self.model,
                "rank": self.rank,
                "n_ranks": self.n_ranks,
                "delta_req": self.delta_req,
                "delta_e": self.delta_e,
                "accounts": {str(u): a.to_dict() for u, a in sorted(self.accounts.items())},
                "global": dict(sorted(self.counters.items())),
                "eprocess": self.eprocess.to_dict(),
                "slots": slots,
                "incident_counts": dict(sorted(self._incident_counts.items())),
                "incidents": [vars(i) for i in self.incidents],
            }

    def flush(self) -> None:
        """Make every event applied so far durable in the log (no-op without a log)."""
        if self.log is not None:
            self.log.flush()

    def save(self, path: str | Path) -> None:
        """Write :meth:`snapshot` as JSON (the input of ``kvcert ledger gate``), after :meth:`flush`, so the
        saved state and the log agree."""
        with self._lock:
            self.flush()
            Path(path).write_text(json.dumps(self.snapshot()))

    def summary(self) -> dict[str, Any]:
        """Operator totals (metrics, CLI): coverage, fallback rate, δ spent, violations, e-process."""
        with self._lock:
            tot = Counter[str]()
            for a in self.accounts.values():
                tot.update(a.counts)
            written = tot["n_written"]
            return {
                "n_accounts": len(self.accounts),
                "n_user_requests": sum(1 for a in self.accounts.values() if a.counts["n_reads"] > 0),
                "coverage": tot["n_read_compressed"] / tot["n_reads"] if tot["n_reads"] else 0.0,
                "fallback_rate": (tot["n_kept_exact"] + tot["n_restored_exact"]) / written if written else 0.0,
                "delta_spent_max": max((a.budget.spent_upper for a in self.accounts.values()), default=0.0),
                "delta_spent_total": sum(a.budget.spent_upper for a in self.accounts.values()),
                **{k: tot[k] for k in _COUNTERS},
                "identity_fail_closed": self.counters["identity_fail_closed"],
                "identity_fail_closed_reads": self.counters["identity_fail_closed_reads"],
                "uid_group_fallbacks": self.counters["uid_group_fallbacks"],
                "n_slot_reuse": self.counters["n_slot_reuse"],
                "faults": {k[6:]: v for k, v in self.counters.items() if k.startswith("fault:")},
                "eprocess": self.eprocess.to_dict(),
            }

    # ------------------------------------------------------------------------------------- internals
    @staticmethod
    def _check_entries(slots: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        o = np.asarray(owners, dtype=np.int64).reshape(-1)
        if s.shape != o.shape:
            raise ValueError(f"slots has {s.size} entries but owners has {o.size}")
        if s.size:
            ordered = np.sort(s) if s.size > 1 else s  # one sort: range (first, last) and distinctness
            check_slot_range(int(ordered[0]), int(ordered[-1]), "slots")
            if s.size > 1 and (ordered[1:] == ordered[:-1]).any():
                raise ValueError("slots must be distinct within one write")
        return s, o

    @staticmethod
    def _enforce(decision: Decision, owners: np.ndarray, rule: Rule) -> np.ndarray:
        states = np.asarray(decision.states, dtype=np.uint8)
        if states.shape != owners.shape or decision.log_factors.shape != owners.shape:
            raise ValueError(f"decision covers {states.shape}, expected {owners.shape}")
        if states.size:
            lo, hi = int(states.min()), int(states.max())
            if not (_COMPRESSED <= lo and hi <= _RESTORED):
                raise ValueError("decision states must be compressed, kept_exact or restored_exact")
            if rule == "deterministic" and hi == _RESTORED:
                raise ValueError("restored_exact requires the probabilistic rule (an audited draw)")
        # Fail closed: no UID -> exact, no matter what the writer proposed.
        lost = owners < 0
        return np.where(lost, np.uint8(_KEPT), states) if lost.any() else states

    def _table(self, pool: str, layer: int) -> LayerSlots:
        if not isinstance(pool, str) or not pool:
            raise ValueError(f"pool must be a non-empty string, got {pool!r}")
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        t = self.tables.get((pool, layer))
        if t is None:
            t = self.tables[(pool, layer)] = LayerSlots()
        return t

    def _account(self, uid: int) -> Account:
        a = self.accounts.get(uid)
        if a is None:
            raise ValueError(f"request UID {uid} has no open account (call open_request first)")
        return a

    def _commit(self, event: Event, previous: np.ndarray | None = None) -> np.ndarray:
        if self.log is not None:
            self.log.append(event)
        return self._apply(event, previous)

    def _incident(
        self,
        kind: str,
        pool: str,
        layer: int,
        slots: np.ndarray,
        gens: np.ndarray,
        owners: np.ndarray,
        readers: np.ndarray | None = None,
    ) -> None:
        n = slots.size
        if n == 0:
            return
        self._incident_counts[kind] += n
        keep = min(self.max_incidents - self._incidents_kept[kind], n)
        self._incidents_kept[kind] += max(keep, 0)
        for j in range(max(keep, 0)):
            rd = UNATTRIBUTED if readers is None else int(readers[j])
            self.incidents.append(Incident(kind, pool, layer, int(slots[j]), int(gens[j]), int(owners[j]), rd))

    def _apply(self, event: Event, previous: np.ndarray | None) -> np.ndarray:
        if isinstance(event, OpenRequest):
            self.accounts[event.uid] = Account(event.uid, RequestBudget(event.delta_req), EProcess(self.delta_e))
            self.uids.advance_past(event.uid)
            return np.zeros(0, dtype=bool)
        if isinstance(event, SlotWrite):
            self._apply_write(event, previous)
            return np.zeros(0, dtype=bool)
        if isinstance(event, SlotRead):
            return self._apply_read(event, _read_key(self._table(event.pool, event.layer), event))
        if isinstance(event, FaultReport):
            self._apply_fault(event)
            return np.zeros(0, dtype=bool)
        if isinstance(event, BudgetCharge):
            self.accounts[event.uid].budget.charge(event.cells, event.delta_loc)
            return np.zeros(0, dtype=bool)
        raise TypeError(f"not a ledger event: {type(event).__name__}")

    def _apply_write(self, ev: SlotWrite, previous: np.ndarray | None) -> None:
        table = self._table(ev.pool, ev.layer)
        if previous is None:
            previous = table.invalidate(ev.slots, ev.owners)
        table.set_states(ev.slots, ev.states)
        gens = table.generation[ev.slots]
        self.counters["n_slot_reuse"] += int(np.count_nonzero((previous >= 0) & (previous != ev.owners)))
        if ev.fallback:
            self.counters["uid_group_fallbacks"] += 1
        owners, states, factors = ev.owners, ev.states, ev.log_factors
        lost = owners < 0
        if lost.any():
            self.counters["identity_fail_closed"] += int(lost.sum())
            self._incident("identity_fail_closed", ev.pool, ev.layer, ev.slots[lost], gens[lost], owners[lost])
            owners, states, factors = owners[~lost], states[~lost], factors[~lost]
        restored = ev.states == _RESTORED
        if restored.any():
            self._incident("auth_violation", ev.pool, ev.layer, ev.slots[restored], gens[restored], ev.owners[restored])
        if owners.size == 0:
            return
        uids, inverse = _groups(owners)
        k = len(uids)
        # per owner and state (unwritten, compressed, kept, restored): one bincount over the whole call
        per_state = np.bincount(inverse * 4 + states, minlength=4 * k).reshape(k, 4).tolist()
        prob = ev.rule == "probabilistic"
        if prob:
            authorised = ~np.isnan(factors)
            n_auth = np.bincount(inverse, weights=authorised, minlength=k).astype(np.int64).tolist()
            sums = np.bincount(inverse, weights=np.where(authorised, factors, 0.0), minlength=k).tolist()
        for j, uid in enumerate(uids):
            a = self.accounts[uid]
            c = a.counts
            _, n_comp, n_kept, n_rest = per_state[j]
            c["n_written"] += n_comp + n_kept + n_rest
            c["n_compressed"] += n_comp
            c["n_kept_exact"] += n_kept
            c["n_restored_exact"] += n_rest
            if ev.rule == "empirical":
                c["n_empirical"] += sum(per_state[j])
            if prob:
                a.budget.spend()  # once per owner per write event, however many readers
                c["n_prob_events"] += 1
                c["n_authorized"] += n_auth[j]
                c["n_auth_violations"] += n_rest
                a.eprocess.add(sums[j], n_auth[j])
        if prob:
            self.eprocess.add(sum(sums), sum(n_auth))

    @staticmethod
    def _grid(ev: SlotRead, table: LayerSlots) -> tuple[int, int] | None:
        """``(s0, c)`` if ``ev`` reads the dense interleaved block ``[s0, s0 + R·c)`` (range ``i`` = slots
        ``s0 + i, s0 + i + R, …``: the certified-cache layout, ``s0 > 0`` after sliding-window trims)."""
        r = ev.counts.size
        s0, c = int(ev.starts[0]), int(ev.counts[0])
        if s0 + r * c > table.state.shape[0] or int(ev.steps[0]) != r:
            return None
        same = ev.counts.min() == ev.counts.max() and ev.steps.min() == ev.steps.max()
        if not (same and (ev.starts - s0 == np.arange(r)).all()):
            return None
        return s0, c

    def _apply_read(self, ev: SlotRead, key: tuple[Any, ...]) -> np.ndarray:
        """Apply a read; ``key`` (:func:`_read_key`) memoises its classification while the table is unchanged
        (the decode steps between two writes of a layer repeat the same read)."""
        if ev.fallback:
            self.counters["uid_group_fallbacks"] += 1
        table = self._table(ev.pool, ev.layer)
        if ev.counts.size == 0:
            return np.zeros(0, dtype=bool)
        memo = table.read_memo
        if memo is not None and memo[0] == key:
            _, totals, no_id, served = memo
            self._account_reads(totals, no_id, ev.shared)
            return served.copy()
        per_range, served, located = self._classify(ev, table, self._grid(ev, table))
        totals, no_id = self._reader_totals(ev, per_range)
        self._account_reads(totals, no_id, ev.shared)
        if located is not None:  # rare: locate every unwritten, stale and foreign read (never memoised)
            self._locate(ev, *located)
        else:
            table.read_memo = (key, totals, no_id, served)
        return served.copy()

    @staticmethod
    def _classify(
        ev: SlotRead, table: LayerSlots, grid: tuple[int, int] | None
    ) -> tuple[list[list[int]], np.ndarray, tuple[np.ndarray, ...] | None]:
        """Per range ``[served, unwritten, foreign, stale]`` entry counts, the per-entry served mask (range-major)
        and, if any read is unwritten, stale or foreign, the per-entry ``(unwritten, stale, foreign, owner,
        generation)`` arrays (range-major) to locate them."""
        r = ev.counts.size
        if grid is not None:  # contiguous views of the dense block in [entry, range] layout, no gather
            s0, c = grid
            block = slice(s0, s0 + r * c)
            state, owner, gen = (a[block].reshape(c, r) for a in (table.state, table.owner, table.generation))
            readers, want = ev.readers, ev.generations
        else:
            readers, slots_e, want = ev.expand()
            state, owner, gen = table.lookup(slots_e)
        unwritten = state == _UNWRITTEN
        served = state == _COMPRESSED
        stale = None
        if int(ev.generations.max()) >= 0:
            stale = (want >= 0) & (want != gen) & ~unwritten
            served &= ~stale
        if int(ev.readers.min()) < 0:
            served &= readers >= 0
        mismatch = owner != readers
        foreign = mismatch & (owner >= 0) & ~unwritten if mismatch.any() else None
        per_range: list[list[int]] = []
        for f in (served, unwritten, foreign, stale):
            if f is None:
                per_range.append([0] * r)
            elif grid is not None:
                per_range.append(f.sum(axis=0).tolist())
            else:  # entries are laid out range by range
                nz = ev.counts > 0
                x = np.zeros(r, dtype=np.int64)
                if nz.any():
                    x[nz] = np.add.reduceat(f.astype(np.int64), (np.cumsum(ev.counts) - ev.counts)[nz])
                per_range.append(x.tolist())

        def flat(x: np.ndarray) -> np.ndarray:  # range-major, the order of ev.expand()
            return x.T.ravel() if grid is not None else x

        located = None
        if any(any(x) for x in per_range[1:]):
            none = np.zeros(state.shape, dtype=bool)
            masks = (unwritten, none if stale is None else stale, none if foreign is None else foreign, owner, gen)
            located = tuple(flat(x) for x in masks)
        return per_range, flat(served), located

    @staticmethod
    def _reader_totals(ev: SlotRead, per_range: list[list[int]]) -> tuple[dict[int, list[int]], int]:
        """Per reader ``[reads, served, unwritten, foreign, stale]`` (one Python pass over the ranges) and
        the number of reads without a reader UID."""
        totals: dict[int, list[int]] = {}
        no_id = 0
        for uid, n, n_served, n_unwritten, n_foreign, n_stale in zip(
            ev.readers.tolist(), ev.counts.tolist(), *per_range, strict=True
        ):
            if uid < 0:
                no_id += n
                continue
            t = totals.get(uid)
            if t is None:
                totals[uid] = [n, n_served, n_unwritten, n_foreign, n_stale]
            else:
                t[0] += n
                t[1] += n_served
                t[2] += n_unwritten
                t[3] += n_foreign
                t[4] += n_stale
        return totals, no_id

    def _account_reads(self, totals: dict[int, list[int]], no_id: int, shared: bool) -> None:
        """Add per-reader read counts to the accounts."""
        if no_id:
            self.counters["identity_fail_closed_reads"] += no_id
        kind = "n_read_shared" if shared else "n_read_foreign_owner"
        for uid, (n, n_served, n_unwritten, n_foreign, n_stale) in totals.items():
            acc = self.accounts[uid].counts
            acc["n_reads"] += n
            acc["n_read_compressed"] += n_served
            acc["n_read_exact"] += n - n_served
            acc["n_read_unwritten"] += n_unwritten
            acc["n_read_stale"] += n_stale
            acc[kind] += n_foreign

    def _locate(
        self,
        ev: SlotRead,
        unwritten: np.ndarray,
        stale: np.ndarray,
        foreign: np.ndarray,
        owner: np.ndarray,
        gen: np.ndarray,
    ) -> None:
        """Record incidents for unwritten, stale and foreign reads; attribute foreign reads to their writers."""
        readers, slots, _ = ev.expand()
        for uid in _distinct(owner[foreign]):  # attributed to the writer; no δ is spent again
            if uid in self.accounts:
                self.accounts[uid].counts["n_read_by_others"] += int(np.count_nonzero(foreign & (owner == uid)))
        for name, mask in (
            ("unwritten_read", unwritten),
            ("stale_read", stale),
            ("shared_read" if ev.shared else "foreign_read", foreign),
        ):
            if mask.any():
                self._incident(name, ev.pool, ev.layer, slots[mask], gen[mask], owner[mask], readers[mask])

    def _apply_fault(self, ev: FaultReport) -> None:
        table = self._table(ev.pool, ev.layer)
        s, o, g = table.lookup(np.array([ev.slot], dtype=np.int64))
        if s[0] == _COMPRESSED:
            table.set_states(np.array([ev.slot]), np.array([_RESTORED], dtype=np.uint8))
        self.counters[f"fault:{ev.kind}"] += 1
        self._incident(f"fault:{ev.kind}", ev.pool, ev.layer, np.array([ev.slot]), g, o)
        self._last_incident[ev.kind] = Incident(f"fault:{ev.kind}", ev.pool, ev.layer, ev.slot, int(g[0]), int(o[0]))
