"""The ``kvcert_*`` series on vLLM's ``/metrics`` with one API server or several (engine-free, no vLLM):
:func:`~kvcert.integrations.vllm.record_metrics.complete_metrics` on the bodies vLLM 0.32 serves in each mode."""

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest, multiprocess

from kvcert.integrations.vllm import record_metrics
from kvcert.integrations.vllm.records import LEDGER_SUMMARY, RecordStore, RequestRecord
from kvcert.integrations.vllm.settings import RECORDS
from kvcert.ledger.ledger import Ledger

FAMILIES = {
    "kvcert_requests",
    "kvcert_decode_reads",
    "kvcert_cells",
    "kvcert_repaired_reads",
    "kvcert_repaired_blocks",
    "kvcert_cells_over_tau",
    "kvcert_page_in_bytes",
    "kvcert_value_repaired_reads",
    "kvcert_violations",
    "kvcert_out_violations",
    "kvcert_max_certificate",
    "kvcert_coverage",
    "kvcert_ledger_requests",
    "kvcert_ledger_eprocess_log_m",
}


@pytest.fixture(autouse=True)
def records(tmp_path, monkeypatch):
    """A records file with two requests and a ledger summary, as the engine writes it."""
    path = tmp_path / "r.sqlite"
    store = RecordStore(path)
    store.put([RequestRecord("cmpl-a-0", reads=4, cells=12), RequestRecord("cmpl-b-0", reads=6, cells=18)])
    store.put_meta(LEDGER_SUMMARY, {**Ledger().summary(), "lanes": 1, "live_requests": 0})
    monkeypatch.setenv(RECORDS, str(path))
    monkeypatch.setattr(record_metrics, "_STORE", [])
    return path


def _kvcert_families(body: bytes) -> Counter:
    """How often each ``kvcert_*`` family is declared (``# TYPE``; a counter's name carries ``_total``)."""
    lines = body.decode().splitlines()
    return Counter(line.split()[2].removesuffix("_total") for line in lines if line.startswith("# TYPE kvcert_"))


def _once(body: bytes) -> bool:
    counts = _kvcert_families(body)
    return FAMILIES <= set(counts) and set(counts.values()) == {1}


def test_multiprocess_body_gets_the_series_appended(tmp_path):
    """Several API servers: vLLM's body comes from a per-scrape registry with only a MultiProcessCollector."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    vllm_body = generate_latest(registry) + b"vllm:num_requests_running 0.0"  # vLLM's own series, no final newline
    assert _kvcert_families(vllm_body) == Counter()
    body = record_metrics.complete_metrics(vllm_body)
    assert body.startswith(vllm_body + b"\n") and _once(body)
    text = body.decode()
    assert 'kvcert_requests_total{tier="exact"} 2.0' in text
    assert 'kvcert_cells_total{tier="certified"} 30.0' in text
    assert 'kvcert_ledger_requests{model="vllm",tier="certified"} 0.0' in text


def test_body_that_has_the_series_is_unchanged():
    """One API server: the default registry (here a stand-in) holds the middleware's RecordCollector."""
    registry = CollectorRegistry()
    registry.register(record_metrics.RecordCollector())
    Gauge("vllm:num_requests_running", "running", registry=registry)
    body = generate_latest(registry)
    assert _once(body) and record_metrics.complete_metrics(body) is body
