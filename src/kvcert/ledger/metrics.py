"""Prometheus metrics for ledgers (coverage, fallback rate, δ spent, violations, e-process, fail-closed).

Values are read from :meth:`Ledger.summary` at scrape time, so the serving hot path pays nothing.
Every gauge is labelled with the model and its tier: the counters are exact counts of recorded events
(``tier="certified"`` for ledger-decided quantities, ``"empirical"`` for rates that summarise traffic).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcert.ledger.ledger import Ledger

_GAUGES: tuple[tuple[str, str, str, str], ...] = (
    ("kvcert_ledger_requests", "n_user_requests", "certified", "request accounts with reads"),
    ("kvcert_ledger_coverage", "coverage", "empirical", "fraction of reads served compressed"),
    ("kvcert_ledger_fallback_rate", "fallback_rate", "empirical", "fraction of written entries kept exact"),
    ("kvcert_ledger_delta_spent_max", "delta_spent_max", "certified", "largest per-request delta spent"),
    ("kvcert_ledger_auth_violations", "n_auth_violations", "certified", "authorised entries restored exact"),
    ("kvcert_ledger_foreign_reads", "n_read_foreign_owner", "certified", "reads of foreign-owned entries"),
    ("kvcert_ledger_unwritten_reads", "n_read_unwritten", "certified", "reads of unwritten slots"),
    ("kvcert_ledger_stale_reads", "n_read_stale", "certified", "reads of a stale generation"),
    (
        "kvcert_ledger_identity_fail_closed",
        "identity_fail_closed",
        "certified",
        "entries written exact because attribution failed",
    ),
    (
        "kvcert_ledger_uid_group_fallbacks",
        "uid_group_fallbacks",
        "certified",
        "first-row attribution fallbacks",
    ),
)


def ledger_families(summaries: Mapping[str, Mapping[str, Any]]) -> Iterator[GaugeMetricFamily]:
    """The ``kvcert_ledger_*`` families of :meth:`Ledger.summary` outputs, one sample per model (also what
    the vLLM plugin's ``/metrics`` exports from the engine's published summary)."""
    for name, key, tier, doc in _GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["model", "tier"])
        for m, s in summaries.items():
            g.add_metric([m, tier], float(s[key]))
        yield g
    g = GaugeMetricFamily(
        "kvcert_ledger_eprocess_log_m",
        "global e-process log M (current and max)",
        labels=["model", "tier", "stat"],
    )
    for m, s in summaries.items():
        e = s["eprocess"]
        g.add_metric([m, "certified", "current"], float(e["log_m"]))
        g.add_metric([m, "certified", "max"], float("nan") if e["log_m_max"] is None else float(e["log_m_max"]))
        g.add_metric([m, "certified", "crossed"], float(e["crossed"]))
    yield g


class LedgerCollector(Collector):
    """Collects the gauges of several ledgers (one per model) at scrape time."""

    def __init__(self, ledgers: dict[str, Ledger]) -> None:
        self.ledgers = ledgers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield one family per quantity, one sample per model."""
        yield from ledger_families({m: led.summary() for m, led in self.ledgers.items()})


def serve_metrics(ledgers: dict[str, Ledger], port: int = 0) -> tuple[WSGIServer, threading.Thread, int]:
    """Serve ``/metrics`` on ``127.0.0.1:port`` (0 = ephemeral); returns ``(server, thread, port)``.

    Stop with ``server.shutdown(); server.server_close()``.
    """
    if not ledgers:
        raise ValueError("ledgers must name at least one model")
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledgers))
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server, thread, int(server.server_port)
