"""Request-level risk ledger: accounts, budgets, slots and generations, identity, event log, sentinels."""

from kvcert.ledger.admission import (
    Decision,
    DitheredAdmission,
    deterministic,
    empirical,
    observed,
    sr_prior_radius,
)
from kvcert.ledger.criteria import Criterion, GateResult, evaluate
from kvcert.ledger.ledger import Account, Incident, Ledger
from kvcert.ledger.log import EventLog, read_events
from kvcert.ledger.observer import LedgerObserver
from kvcert.ledger.replay import diff_states, replay
from kvcert.ledger.request_budget import RequestBudget, telescoping_delta
from kvcert.ledger.running_eprocess import EProcess
from kvcert.ledger.sentinel import SampledSentinel, latency_table, miss_probability, rounds_needed
from kvcert.ledger.slots import SlotKey, SlotState
from kvcert.ledger.uids import UNATTRIBUTED, UidAllocator

__all__ = [
    "UNATTRIBUTED",
    "Account",
    "Criterion",
    "Decision",
    "DitheredAdmission",
    "EProcess",
    "EventLog",
    "GateResult",
    "Incident",
    "Ledger",
    "LedgerObserver",
    "RequestBudget",
    "SampledSentinel",
    "SlotKey",
    "SlotState",
    "UidAllocator",
    "deterministic",
    "diff_states",
    "empirical",
    "evaluate",
    "latency_table",
    "miss_probability",
    "observed",
    "read_events",
    "replay",
    "rounds_needed",
    "sr_prior_radius",
    "telescoping_delta",
]
