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

Each API server process loads this middleware (with ``--api-server-count N`` vLLM starts N of them, each
building its own app from the same arguments) and opens the shared records file itself.

Importing this module also registers :class:`~kvcert.integrations.vllm.record_metrics.RecordCollector` (the
``kvcert_*`` and ``kvcert_ledger_*`` series) in prometheus_client's default registry, which vLLM's ``/metrics``
serves with one API server. With several, vLLM serves ``/metrics`` from a multiprocess registry built per scrape,
which no collector can join; the middleware then appends the series to the ``/metrics`` body
(:func:`~kvcert.integrations.vllm.record_metrics.complete_metrics`: each series once in both cases).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from prometheus_client import REGISTRY
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvcert.integrations.vllm.plugin import uncertified_reason
from kvcert.integrations.vllm.record_metrics import RecordCollector, complete_metrics, record_store
from kvcert.integrations.vllm.records import merge
from kvcert.integrations.vllm.sse import annotate_stream

PATHS = ("/v1/completions", "/v1/chat/completions")
METRICS = "/metrics"
FIELD = "kvcert"

_UNCERTIFIED: list[str | None] = []


def _uncertified() -> str | None:
    """Why this server's responses are uncertified (``None``: certified), computed once per process."""
    if not _UNCERTIFIED:
        _UNCERTIFIED.append(uncertified_reason())
    return _UNCERTIFIED[0]


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


def _headers(response: Response) -> dict[str, str]:
    """The response's headers without ``content-length`` (the body is rewritten)."""
    return {k: v for k, v in response.headers.items() if k.lower() != "content-length"}


async def certificate_middleware(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Add the ``"kvcert"`` field to completion responses, streaming or not, and the ``kvcert_*`` series to a
    ``/metrics`` text body that lacks them (see the module docstring)."""
    response = await call_next(request)
    kind = response.headers.get("content-type", "")
    if response.status_code != 200:
        return response
    if request.url.path == METRICS and kind.startswith("text/plain") and "content-encoding" not in response.headers:
        body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[attr-defined]
        return Response(complete_metrics(body), response.status_code, _headers(response))
    if request.url.path not in PATHS:
        return response
    if kind.startswith("text/event-stream"):
        stream = annotate_stream(response.body_iterator, response_record)  # type: ignore[attr-defined]
        return StreamingResponse(stream, response.status_code, _headers(response), media_type="text/event-stream")
    if not kind.startswith("application/json"):
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[attr-defined]
    data = json.loads(body)
    if isinstance(data, dict) and isinstance(data.get("id"), str):
        data[FIELD] = response_record(data["id"])
    return Response(json.dumps(data), response.status_code, _headers(response), media_type="application/json")


REGISTRY.register(RecordCollector())
