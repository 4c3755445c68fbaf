"""API-server side of the vLLM plugin: the per-response certificate field and the ``kvcert_*`` metrics.

``kvcert serve`` passes ``--middleware kvcert.integrations.vllm.http.certificate_middleware`` to vLLM's OpenAI
server, which imports this module in the API server process. The middleware adds a ``"kvcert"`` field to every
non-streaming ``/v1/completions`` and ``/v1/chat/completions`` JSON response: the request's record
(:meth:`~kvcert.integrations.vllm.records.RequestRecord.summary`), read from the records file the engine
writes (``KVCERT_VLLM_RECORDS``) by the response id (the engine's ids extend it with per-choice suffixes; the
records of all of them are merged). A streaming response (``"stream": true``) gets the same field in one extra
event before ``data: [DONE]`` (:mod:`kvcert.integrations.vllm.sse`). When the plugin serves uncertified
(``--allow-uncertified`` on a platform it cannot certify) the field says so instead: ``{"certified": false,
"reason": ...}``.

Importing this module also registers :class:`RecordCollector` in prometheus_client's default registry, which
vLLM's ``/metrics`` serves (single API server); the collector reads the records file at scrape time: the
``kvcert_*`` series over the request records and, when the request ledger is on, the ``kvcert_ledger_*`` series
of the engine's ledger summary (published into the records file by the engine at most every 0.5 s,
:mod:`kvcert.integrations.vllm.ledger_feed`), labelled ``model="vllm"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvcert.integrations.vllm.plugin import uncertified_reason
from kvcert.integrations.vllm.records import RecordStore, RequestRecord, merge
from kvcert.integrations.vllm.runtime import LEDGER_SUMMARY
from kvcert.integrations.vllm.settings import RECORDS
from kvcert.integrations.vllm.sse import annotate_stream
from kvcert.ledger.metrics import ledger_families

PATHS = ("/v1/completions", "/v1/chat/completions")
FIELD = "kvcert"

_STORE: list[RecordStore] = []
_UNCERTIFIED: list[str | None] = []


def _uncertified() -> str | None:
    """Why this server's responses are uncertified (``None``: certified), computed once per process."""
    if not _UNCERTIFIED:
        _UNCERTIFIED.append(uncertified_reason())
    return _UNCERTIFIED[0]


def record_store() -> RecordStore:
    """The records file of this server (``KVCERT_VLLM_RECORDS``; ``RuntimeError`` when unset)."""
    if not _STORE:
        path = os.environ.get(RECORDS)
        if not path:
            raise RuntimeError(f"{RECORDS} is not set: the kvcert middleware needs the engine's records file")
        _STORE.append(RecordStore(path))
    return _STORE[0]


def response_record(response_id: str) -> dict[str, object]:
    """The response field for ``response_id``: the merged summary of its engine requests, or an ``error`` entry
    when the engine wrote none (e.g. the plugin served no layer of it); ``{"certified": False, "reason": ...}``
    when the plugin serves uncertified."""
    reason = _uncertified()
    if reason is not None:
        return {"certified": False, "reason": reason}
    records = record_store().matching(response_id)
    if not records:
        return {"error": f"no kvcert record for {response_id!r}"}
    summary = merge(records, response_id).summary()
    summary.pop("finished", None)
    summary["engine_requests"] = sorted(r.request_id for r in records)
    uids = sorted(r.ledger_uid for r in records if r.ledger_uid is not None)
    if uids:
        summary["ledger_uids"] = uids
    summary["certified"] = True
    return summary


async def certificate_middleware(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Add the ``"kvcert"`` field to completion responses, streaming or not (see the module docstring)."""
    response = await call_next(request)
    kind = response.headers.get("content-type", "")
    if request.url.path not in PATHS or response.status_code != 200:
        return response
    if kind.startswith("text/event-stream"):
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        stream = annotate_stream(response.body_iterator, response_record)  # type: ignore[attr-defined]
        return StreamingResponse(stream, response.status_code, headers, media_type="text/event-stream")
    if not kind.startswith("application/json"):
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[attr-defined]
    data = json.loads(body)
    if isinstance(data, dict) and isinstance(data.get("id"), str):
        data[FIELD] = response_record(data["id"])
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    return Response(json.dumps(data), response.status_code, headers, media_type="application/json")


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


REGISTRY.register(RecordCollector())
