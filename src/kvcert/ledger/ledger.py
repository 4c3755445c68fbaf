"""The request-level risk ledger: accounts, slots, budgets, e-processes and incidents (§5.1, §5.6–§5.10).

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
from kvcert.ledger.budget import RequestBudget
from kvcert.ledger.eprocess import EProcess
from kvcert.ledger.events import RULES, Event, FaultReport, OpenRequest, Rule, SlotRead, SlotWrite
from kvcert.ledger.identity import UNATTRIBUTED, UidAllocator
from kvcert.ledger.log import EventLog
from kvcert.ledger.slots import LayerSlots, SlotKey, SlotState

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
    """Distinct values in ascending order (fast path for the common single-owner batch)."""
    if values.size == 0:
        return []
    if values.size <= 256:  # Python's set beats np.unique's fixed cost on the small per-call arrays
        return sorted(set(values.tolist()))
    return [int(v) for v in np.unique(values)]


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
        log: event log every event is committed to *before* it is applied.
        model: label for metrics.
        max_incidents: located incidents kept per kind (all are counted).
    """

    def __init__(
        self,
        delta_req: float = 0.01,
        delta_e: float = 0.01,
        log: EventLog | None = None,
        model: str = "model",
        max_incidents: int = 256,
    ) -> None:
        RequestBudget(delta_req)  # validates delta_req
        alarm_threshold(delta_e)  # validates delta_e
        if max_incidents < 0:
            raise ValueError(f"max_incidents must be >= 0, got {max_incidents}")
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
            log.set_meta(
                {
                    "delta_req": self.delta_req,
                    "delta_e": self.delta_e,
                    "model": model,
                    "max_incidents": max_incidents,
                }
            )

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
            if rule == "probabilistic":
                for uid in owner_ids:
                    shares[owners_a == uid] = self.accounts[uid].budget.next_share()
            nan = np.full(slots_a.size, np.nan)
            try:
                decision = (
                    decide(shares, owners_a)
                    if rule != "empirical"
                    else Decision(np.full(slots_a.size, SlotState.KEPT_EXACT, dtype=np.uint8), nan)
                )
            except BaseException:
                unwritten = np.full(slots_a.size, SlotState.UNWRITTEN, dtype=np.uint8)
                self._commit(
                    SlotWrite(pool, layer, slots_a, owners_a, unwritten, "deterministic", nan, fallback),
                    previous,
                )
                raise
            states = self._enforce(decision, owners_a, rule)
            factors = np.where(states == _KEPT, np.nan, decision.log_factors)
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
        r = np.asarray(readers, dtype=np.int64).reshape(-1)
        n = r.size
        st = np.asarray(starts, dtype=np.int64).reshape(-1)
        ct = np.asarray(counts, dtype=np.int64).reshape(-1)
        sp = np.ones(n, dtype=np.int64) if steps is None else np.asarray(steps, dtype=np.int64).reshape(-1)
        gen = (
            np.full(n, -1, dtype=np.int64)
            if generations is None
            else np.asarray(generations, dtype=np.int64).reshape(-1)
        )
        for name, a in (("starts", st), ("counts", ct), ("steps", sp), ("generations", gen)):
            if a.size != n:
                raise ValueError(f"{name} has {a.size} entries, readers has {n}")
        if np.any(st < 0) or np.any(ct < 0) or np.any(sp < 0):
            raise ValueError("starts, counts and steps must be >= 0")
        with self._lock:
            for uid in _distinct(r[r >= 0]):
                self._account(uid)
            return self._commit(SlotRead(pool, layer, r, st, sp, ct, gen, shared, fallback))

    def report_fault(self, kind: str, pool: str, layer: int, slot: int, detail: str = "") -> Incident:
        """Record a detected fault at ``(pool, layer, slot)``; a compressed slot turns ``restored_exact``."""
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
        """Apply one already-committed event (replay)."""
        with self._lock:
            self._apply(event, None)

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
                "delta_req": self.delta_req,
                "delta_e": self.delta_e,
                "accounts": {str(u): a.to_dict() for u, a in sorted(self.accounts.items())},
                "global": dict(sorted(self.counters.items())),
                "eprocess": self.eprocess.to_dict(),
                "slots": slots,
                "incident_counts": dict(sorted(self._incident_counts.items())),
                "incidents": [vars(i) for i in self.incidents],
            }

    def save(self, path: str | Path) -> None:
        """Write :meth:`snapshot` as JSON (the input of ``kvcert ledger gate``)."""
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
        if np.any(s < 0):
            raise ValueError("slots must be >= 0")
        if (len(set(s.tolist())) if s.size <= 256 else np.unique(s).size) != s.size:
            raise ValueError("slots must be distinct within one write")
        return s, o

    @staticmethod
    def _enforce(decision: Decision, owners: np.ndarray, rule: Rule) -> np.ndarray:
        states = np.asarray(decision.states, dtype=np.uint8)
        if states.shape != owners.shape or decision.log_factors.shape != owners.shape:
            raise ValueError(f"decision covers {states.shape}, expected {owners.shape}")
        if states.size and not (_COMPRESSED <= int(states.min()) and int(states.max()) <= _RESTORED):
            raise ValueError("decision states must be compressed, kept_exact or restored_exact")
        if rule == "deterministic" and np.any(states == _RESTORED):
            raise ValueError("restored_exact requires the probabilistic rule (an audited draw)")
        # Fail closed: no UID -> exact, no matter what the writer proposed.
        return np.where(owners < 0, np.uint8(_KEPT), states)

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
            return self._apply_read(event)
        if isinstance(event, FaultReport):
            self._apply_fault(event)
            return np.zeros(0, dtype=bool)
        raise TypeError(f"not a ledger event: {type(event).__name__}")

    def _apply_write(self, ev: SlotWrite, previous: np.ndarray | None) -> None:
        table = self._table(ev.pool, ev.layer)
        if previous is None:
            previous = table.invalidate(ev.slots, ev.owners)
        table.state[ev.slots] = ev.states
        gens = table.generation[ev.slots]
        self.counters["n_slot_reuse"] += int(np.count_nonzero((previous >= 0) & (previous != ev.owners)))
        if ev.fallback:
            self.counters["uid_group_fallbacks"] += 1
        lost = ev.owners < 0
        if lost.any():
            self.counters["identity_fail_closed"] += int(lost.sum())
            self._incident("identity_fail_closed", ev.pool, ev.layer, ev.slots[lost], gens[lost], ev.owners[lost])
        restored = ev.states == _RESTORED
        self._incident("auth_violation", ev.pool, ev.layer, ev.slots[restored], gens[restored], ev.owners[restored])
        factors_all = []
        for uid in _distinct(ev.owners[~lost]):
            a = self.accounts[uid]
            mine = ev.owners == uid
            st = ev.states[mine]
            c = a.counts
            c["n_written"] += int(np.count_nonzero(st != _UNWRITTEN))
            c["n_compressed"] += int(np.count_nonzero(st == _COMPRESSED))
            c["n_kept_exact"] += int(np.count_nonzero(st == _KEPT))
            c["n_restored_exact"] += int(np.count_nonzero(st == _RESTORED))
            if ev.rule == "empirical":
                c["n_empirical"] += int(st.size)
            if ev.rule == "probabilistic":
                a.budget.spend()  # once per owner per write event, however many readers
                c["n_prob_events"] += 1
                f = ev.log_factors[mine]
                f = f[~np.isnan(f)]
                c["n_authorized"] += int(f.size)
                c["n_auth_violations"] += int(np.count_nonzero(st == _RESTORED))
                a.eprocess.update(f)
                factors_all.append(f)
        if factors_all:
            self.eprocess.update(np.concatenate(factors_all))

    @staticmethod
    def _grid(ev: SlotRead, table: LayerSlots) -> int:
        """Entries per range if ``ev`` reads the dense interleaved block ``[0, R·c)`` (range ``i`` = slots
        ``i, i+R, …``, the certified-cache layout), else -1."""
        r = ev.counts.size
        if r == 0:
            return -1
        c = int(ev.counts[0])
        ok = (ev.counts == c).all() and (ev.steps == r).all() and (ev.starts == np.arange(r)).all()
        return c if ok and c * r <= table.state.shape[0] else -1

    def _apply_read(self, ev: SlotRead) -> np.ndarray:
        if ev.fallback:
            self.counters["uid_group_fallbacks"] += 1
        table = self._table(ev.pool, ev.layer)
        r = ev.counts.size
        c = self._grid(ev, table)
        if c >= 0:  # fast path: views of the dense block in [range, entry] layout, no gather
            state, owner, gen = (a[: r * c].reshape(c, r).T for a in (table.state, table.owner, table.generation))
            readers, want = ev.readers[:, None], ev.generations[:, None]
        else:
            readers_e, slots_e, want_e = ev.expand()
            state, owner, gen = table.lookup(slots_e)
            readers, want = readers_e, want_e
        unwritten = state == _UNWRITTEN
        stale = (want >= 0) & (want != gen) & ~unwritten
        served = (state == _COMPRESSED) & ~stale & (readers >= 0)
        foreign = (owner >= 0) & (owner != readers) & ~unwritten
        flags = np.stack([served, unwritten, stale, foreign]).astype(np.int64)
        if c >= 0:
            per_range = flags.sum(axis=2)
        else:  # entries are laid out range by range
            per_range = np.zeros((4, r), dtype=np.int64)
            nz = ev.counts > 0
            if nz.any():
                per_range[:, nz] = np.add.reduceat(flags, (np.cumsum(ev.counts) - ev.counts)[nz], axis=1)
        no_id = ev.readers < 0
        if no_id.any():
            self.counters["identity_fail_closed_reads"] += int(ev.counts[no_id].sum())
        kind = "n_read_shared" if ev.shared else "n_read_foreign_owner"
        for uid in _distinct(ev.readers[~no_id]):
            mine = ev.readers == uid
            n = int(ev.counts[mine].sum())
            n_served, n_unwritten, n_stale, n_foreign = per_range[:, mine].sum(axis=1).tolist()
            acc = self.accounts[uid].counts
            acc["n_reads"] += n
            acc["n_read_compressed"] += n_served
            acc["n_read_exact"] += n - n_served
            acc["n_read_unwritten"] += n_unwritten
            acc["n_read_stale"] += n_stale
            acc[kind] += n_foreign
        if per_range[1:].any():  # rare: locate, attribute foreign reads to their writers
            readers_e, slots_e, _ = ev.expand()
            flat = [x.ravel() for x in (unwritten, stale, foreign, owner, gen)]
            unwritten_f, stale_f, foreign_f, owner_f, gen_f = flat
            for uid in _distinct(owner_f[foreign_f]):  # attributed to the writer; no δ is spent again
                if uid in self.accounts:
                    self.accounts[uid].counts["n_read_by_others"] += int(np.count_nonzero(foreign_f & (owner_f == uid)))
            for name, mask in (
                ("unwritten_read", unwritten_f),
                ("stale_read", stale_f),
                ("shared_read" if ev.shared else "foreign_read", foreign_f),
            ):
                if mask.any():
                    self._incident(name, ev.pool, ev.layer, slots_e[mask], gen_f[mask], owner_f[mask], readers_e[mask])
        return served.ravel()

    def _apply_fault(self, ev: FaultReport) -> None:
        table = self._table(ev.pool, ev.layer)
        s, o, g = table.lookup(np.array([ev.slot], dtype=np.int64))
        if s[0] == _COMPRESSED:
            table.state[ev.slot] = _RESTORED
        self.counters[f"fault:{ev.kind}"] += 1
        self._incident(f"fault:{ev.kind}", ev.pool, ev.layer, np.array([ev.slot]), g, o)
        self._last_incident[ev.kind] = Incident(f"fault:{ev.kind}", ev.pool, ev.layer, ev.slot, int(g[0]), int(o[0]))
