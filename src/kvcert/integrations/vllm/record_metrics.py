"""The ``kvcert_*`` Prometheus series on vLLM's ``/metrics``, with one API server or several.

:class:`RecordCollector` reads the shared records file (``KVCERT_VLLM_RECORDS``) at scrape time: the ``kvcert_*``
series over the request records and, when the request ledger is on, the ``kvcert_ledger_*`` series of the
engine's ledger summary (published into the records file by the engine at most every 0.5 s,
:mod:`kvcert.integrations.vllm.ledger_feed`), labelled ``model="vllm"``. Its values are complete in any process
that can open the file, so nothing is aggregated across API server processes.

How vLLM 0.32 answers ``GET /metrics`` (``vllm/entrypoints/serve/instrumentator/metrics.py``, ``attach_router``):
the route is prometheus-fastapi-instrumentator's ``expose`` endpoint (registered before vLLM's ``/metrics``
mount, so it wins), which serves the text format of

* **one API server**: the registry vLLM gives it, prometheus_client's default ``REGISTRY``, where the middleware
  module (:mod:`kvcert.integrations.vllm.http`) registers a :class:`RecordCollector` at import;
* **several API servers** (``--api-server-count N > 1``; vLLM sets ``PROMETHEUS_MULTIPROC_DIR``,
  ``setup_multiprocess_prometheus`` in ``vllm/entrypoints/cli/serve.py``): a new ``CollectorRegistry`` per scrape
  holding only a ``MultiProcessCollector``, which merges the per-process files that vLLM's own metrics write
  (``prometheus_fastapi_instrumentator/instrumentation.py``, ``expose``). No custom collector can join it.

The middleware therefore passes every ``/metrics`` text body through :func:`complete_metrics`, which appends the
series of a registry holding only a :class:`RecordCollector` when the body lacks them (several API servers) and
leaves it unchanged when it has them (one API server): each series appears exactly once either way, whichever
API server process answers the scrape.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcert.integrations.vllm.records import LEDGER_SUMMARY, RecordStore, RequestRecord, merge
from kvcert.integrations.vllm.settings import RECORDS
from kvcert.ledger.metrics import ledger_families

#: the start of the sample line by which a ``/metrics`` body shows that it already holds the ``kvcert_*`` series
PRESENT = b"\nkvcert_requests_total{"

_STORE: list[RecordStore] = []


def record_store() -> RecordStore:
    """The records file of this server (``KVCERT_VLLM_RECORDS``; ``RuntimeError`` when unset)."""
    if not _STORE:
        path = os.environ.get(RECORDS)
        if not path:
            raise RuntimeError(f"{RECORDS} is not set: the kvcert middleware needs the engine's records file")
        _STORE.append(RecordStore(path))
    return _STORE[0]


class RecordCollector(Collector):
    """``kvcert_*`` series over every request in the records file, read at scrape time (the serving path pays
    nothing). Each family carries a ``tier`` label: ``certified`` for quantities decided by certificates,
    ``exact`` for counts of what the plugin did, ``empirical`` for shares of the traffic, ``measured`` for
    validate-mode checks against exact attention."""

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """One sample per family, summed / maximised over the records; then the ledger's families."""
        path = os.environ.get(RECORDS)
        records: list[RequestRecord] = record_store().all() if path else []
        total = merge(records, "all")
        counters = (
            ("kvcert_requests", "requests with a kvcert record", "exact", len(records)),
            ("kvcert_decode_reads", "per-layer KV-head decode reads through the certified path", "exact", total.reads),
            ("kvcert_cells", "(layer, query head, step) cells certified", "certified", total.cells),
            (
                "kvcert_repaired_reads",
                "KV-head reads repaired exactly from the host tier (the head, or some of its blocks)",
                "exact",
                total.repaired_reads,
            ),
            ("kvcert_repaired_blocks", "token blocks paged in by block repairs", "exact", total.repaired_blocks),
            (
                "kvcert_value_repaired_reads",
                "KV-head reads the value gate served exact values from the host tier",
                "exact",
                total.value_repaired_reads,
            ),
            (
                "kvcert_cells_over_tau",
                "cells whose certificate exceeded tau before repair",
                "certified",
                total.cells_over_tau,
            ),
            ("kvcert_page_in_bytes", "bytes paged in from the host tier by repairs", "exact", total.bytes_paged),
            (
                "kvcert_violations",
                "validate mode: cells whose true TV exceeded the certificate",
                "measured",
                total.violations,
            ),
            (
                "kvcert_out_violations",
                "validate mode: cells whose true output error exceeded the output bound",
                "measured",
                total.out_violations,
            ),
        )
        for name, doc, tier, value in counters:
            c = CounterMetricFamily(name, doc, labels=["tier"])
            c.add_metric([tier], float(value))
            yield c
        gauges = (
            (
                "kvcert_max_certificate",
                "largest served certificate over all requests",
                "certified",
                total.max_certificate,
            ),
            ("kvcert_coverage", "share of KV-head reads served compressed (no repair)", "empirical", total.coverage),
        )
        for name, doc, tier, level in gauges:
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            g.add_metric([tier], float(level))
            yield g
        summary = record_store().get_meta(LEDGER_SUMMARY) if path else None
        if isinstance(summary, dict):
            yield from ledger_families({"vllm": summary})


_OWN = CollectorRegistry()
_OWN.register(RecordCollector())


def complete_metrics(body: bytes) -> bytes:
    """A Prometheus text-format body with every ``kvcert_*`` / ``kvcert_ledger_*`` series exactly once: ``body``
    itself when it already has them (its registry holds a :class:`RecordCollector`), else ``body`` followed by the
    series of this process's own collector (see the module docstring)."""
    if PRESENT in body:
        return body
    separator = b"\n" if body and not body.endswith(b"\n") else b""
    return body + separator + generate_latest(_OWN)
