"""The ``kvcert_*`` series on vLLM's ``/metrics`` in both of vLLM's registry modes (engine-free, no vLLM): the
hook on ``get_prometheus_registry`` (:mod:`kvcert.integrations.vllm.record_metrics`), exercised on a stand-in module
that builds registries as ``vllm/v1/metrics/prometheus.py`` does (0.32)."""

import os
import subprocess
import sys
import types
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from kvcert.integrations.vllm import record_metrics
from kvcert.integrations.vllm.records import LEDGER_SUMMARY, RecordStore, RequestRecord
from kvcert.integrations.vllm.settings import RECORDS
from kvcert.ledger.ledger import Ledger

FAMILIES = (
    "kvcert_requests",
    "kvcert_decode_reads",
    "kvcert_cells",
    "kvcert_repaired_reads",
    "kvcert_cells_over_tau",
    "kvcert_page_in_bytes",
    "kvcert_violations",
    "kvcert_max_certificate",
    "kvcert_coverage",
    "kvcert_ledger_requests",
    "kvcert_ledger_eprocess_log_m",
)


def _vllm_prometheus() -> types.ModuleType:
    """A module whose ``get_prometheus_registry`` behaves like vLLM 0.32's: a fresh registry with a
    ``MultiProcessCollector`` when ``PROMETHEUS_MULTIPROC_DIR`` is set, else one process-wide registry."""
    module = types.ModuleType("vllm_prometheus_stand_in")
    default = CollectorRegistry()

    def get_prometheus_registry() -> CollectorRegistry:
        if os.getenv("PROMETHEUS_MULTIPROC_DIR") is not None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return registry
        return default

    module.get_prometheus_registry = get_prometheus_registry
    return module


@pytest.fixture
def records(tmp_path, monkeypatch):
    """A records file with two requests and a ledger summary, as the engine writes it."""
    path = tmp_path / "r.sqlite"
    store = RecordStore(path)
    store.put([RequestRecord("cmpl-a-0", reads=4, cells=12), RequestRecord("cmpl-b-0", reads=6, cells=18)])
    store.put_meta(LEDGER_SUMMARY, {**Ledger().summary(), "lanes": 1, "live_requests": 0})
    monkeypatch.setenv(RECORDS, str(path))
    monkeypatch.setattr(record_metrics, "_STORE", [])
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    return path


def _once(registry: CollectorRegistry) -> bool:
    """Whether the exposition of ``registry`` has every family of ``FAMILIES`` and each ``kvcert_*`` family once
    (its ``# TYPE`` line; a counter's name carries ``_total``)."""
    lines = generate_latest(registry).decode().splitlines()
    counts = Counter(line.split()[2].removesuffix("_total") for line in lines if line.startswith("# TYPE kvcert_"))
    return set(FAMILIES) <= set(counts) and set(counts.values()) == {1}


def test_multiprocess_registries_get_the_series_once(records, tmp_path, monkeypatch):
    module = _vllm_prometheus()
    record_metrics.hook_registry(module)
    record_metrics.hook_registry(module)  # idempotent: not wrapped twice
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    first, second = module.get_prometheus_registry(), module.get_prometheus_registry()
    assert first is not second  # one per API server process in vLLM
    for registry in (first, second):
        assert _once(registry)
        text = generate_latest(registry).decode()
        assert 'kvcert_requests_total{tier="exact"} 2.0' in text
        assert 'kvcert_cells_total{tier="certified"} 30.0' in text


def test_single_registry_registered_by_middleware_and_hook_has_the_series_once(records):
    module = _vllm_prometheus()
    registry = module.get_prometheus_registry()
    record_metrics.register_collector(registry)  # what importing the middleware does with prometheus' REGISTRY
    record_metrics.hook_registry(module)
    assert module.get_prometheus_registry() is registry
    assert _once(registry)


def test_install_hooks_the_factory_and_an_already_imported_router(records, tmp_path, monkeypatch):
    source = _vllm_prometheus()
    router = types.ModuleType("router")
    router.get_prometheus_registry = source.get_prometheus_registry  # bound at its import, before the hook
    monkeypatch.setitem(sys.modules, record_metrics.VLLM_REGISTRY_MODULE, source)
    monkeypatch.setitem(sys.modules, record_metrics.VLLM_METRICS_ROUTER, router)
    record_metrics.install_vllm_hook()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    for module in (source, router):
        assert _once(module.get_prometheus_registry())


def test_the_hook_module_loads_no_numba():
    """The plugin imports it in every vLLM process before vLLM's worker scans all loaded modules for Triton
    kernels, which fails on llvmlite's function wrappers (loaded with kvcert's numba kernels)."""
    code = "import sys, kvcert.integrations.vllm.record_metrics; print('llvmlite' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
