"""The ``kvcert_*`` Prometheus series of vLLM's ``/metrics`` and the hook that puts them there in every mode.

:class:`RecordCollector` reads the shared records file (``KVCERT_VLLM_RECORDS``) at scrape time: the ``kvcert_*``
series over the request records and, when the request ledger is on, the ``kvcert_ledger_*`` series of the
engine's ledger summary (published into the records file by the engine at most every 0.5 s,
:mod:`kvcert.integrations.vllm.ledger_feed`), labelled ``model="vllm"``. Its values are complete in any process
that can open the file, so one API server's collector is enough; nothing is aggregated across processes.

vLLM's ``/metrics`` serves the registry returned by ``vllm.v1.metrics.prometheus.get_prometheus_registry()``
(called once per API server process by ``vllm/entrypoints/serve/instrumentator/metrics.py``, ``attach_router``,
while the app is built):

* **one API server**: prometheus_client's default ``REGISTRY``; the middleware module
  (:mod:`kvcert.integrations.vllm.http`) registers the collector there at import;
* **several API servers** (``--api-server-count N > 1``): vLLM sets ``PROMETHEUS_MULTIPROC_DIR``
  (``setup_multiprocess_prometheus``, ``vllm/entrypoints/cli/serve.py``) and every API server process builds a
  fresh ``CollectorRegistry`` holding only a ``MultiProcessCollector`` (which merges the per-process metric
  files vLLM's own metrics write; a custom collector has no file). :func:`install_vllm_hook`, run by the plugin
  in every vLLM process before the app is built, wraps ``get_prometheus_registry`` so that the registry it
  returns holds one :class:`RecordCollector`. A scrape is answered by one API server process, from its own
  registry, so each series appears once.

:func:`register_collector` adds at most one collector to a registry, so both paths together never duplicate a
series. Pure prometheus_client: nothing here imports vLLM except :func:`install_vllm_hook`, nor kvcert's read path
(the plugin imports this module in every vLLM process, and vLLM's worker scans every loaded module for Triton
kernels at start-up: ``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``, which fails on llvmlite's
``_lib_fn_wrapper``, loaded with kvcert's numba kernels).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcert.integrations.vllm.records import LEDGER_SUMMARY, RecordStore, RequestRecord, merge
from kvcert.integrations.vllm.settings import RECORDS
from kvcert.ledger.metrics import ledger_families

#: where vLLM 0.32 defines ``get_prometheus_registry``, and the module that builds ``/metrics`` from it (it
#: binds the name at its import, so it is wrapped too when it was imported before the hook)
VLLM_REGISTRY_MODULE = "vllm.v1.metrics.prometheus"
VLLM_METRICS_ROUTER = "vllm.entrypoints.serve.instrumentator.metrics"
_HOOKED = "__kvcert_hooked__"

_STORE: list[RecordStore] = []
_REGISTRIES: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()


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
                "KV-head reads repaired exactly from the host tier",
                "exact",
                total.repaired_reads,
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


def register_collector(registry: CollectorRegistry) -> CollectorRegistry:
    """Register one :class:`RecordCollector` in ``registry`` unless this process already did; return
    ``registry`` (so the same registry registered twice still exposes each ``kvcert_*`` series once)."""
    if registry not in _REGISTRIES:
        registry.register(RecordCollector())
        _REGISTRIES.add(registry)
    return registry


def hook_registry(module: ModuleType) -> None:
    """Replace ``module.get_prometheus_registry`` by a wrapper that passes every registry it returns through
    :func:`register_collector` (idempotent: a wrapped function is not wrapped again)."""
    original: Callable[[], CollectorRegistry] = module.get_prometheus_registry
    if getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def get_prometheus_registry() -> CollectorRegistry:
        return register_collector(original())

    setattr(get_prometheus_registry, _HOOKED, True)
    setattr(module, "get_prometheus_registry", get_prometheus_registry)  # noqa: B010 (ModuleType declares no such attribute)


def install_vllm_hook() -> None:
    """Hook vLLM's ``get_prometheus_registry`` (see the module docstring): in its defining module, and in the
    ``/metrics`` router module when that is already imported (it bound the name then). Imports vLLM."""
    hook_registry(importlib.import_module(VLLM_REGISTRY_MODULE))
    router = sys.modules.get(VLLM_METRICS_ROUTER)
    if router is not None:
        hook_registry(router)
