"""The kvcert summary of a **streaming** completion: one extra server-sent event before ``data: [DONE]``.

Pure Python (no vLLM or starlette import), used by :func:`kvcert.integrations.vllm.http.certificate_middleware`
for ``"stream": true`` responses. Events pass through as they arrive (no token is held back); the stream's last
completion chunk is remembered, and when vLLM sends ``data: [DONE]`` one event is inserted before it, shaped like
the usage chunk of OpenAI's streaming API (same ``id``, ``object``, ``created``, ``model``, ``"choices": []``)
and carrying the ``"kvcert"`` field the non-streaming response carries. By then the engine has written the
request's record: it is written at the end of each engine step, before the step's tokens are sampled.
A stream that ends without ``[DONE]`` (an error) gets no summary event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable

DONE = b"data: [DONE]"
FIELD = "kvcert"


def summary_event(last: dict[str, object], summary: dict[str, object]) -> bytes:
    """The inserted event: the last chunk's identity fields, no choices, and ``summary`` as ``"kvcert"``."""
    event: dict[str, object] = {k: last[k] for k in ("id", "object", "created", "model") if k in last}
    event["choices"] = []
    event[FIELD] = summary
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def annotate_stream(
    chunks: AsyncIterable[bytes | str], lookup: Callable[[str], dict[str, object]]
) -> AsyncIterator[bytes]:
    """Pass ``chunks`` (an SSE body, split anywhere) through, inserting :func:`summary_event` before
    ``data: [DONE]``; ``lookup(response id)`` gives the summary."""
    buffer = b""
    last: dict[str, object] | None = None
    async for chunk in chunks:
        buffer += chunk.encode() if isinstance(chunk, str) else chunk
        out = b""
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.strip()
            if data == DONE and last is not None and isinstance(last.get("id"), str):
                out += summary_event(last, lookup(str(last["id"])))
            elif data.startswith(b"data: {"):
                try:
                    parsed = json.loads(data[6:])
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict) and "id" in parsed:
                    last = parsed
            out += event + b"\n\n"
        if out:
            yield out
    if buffer:
        yield buffer
