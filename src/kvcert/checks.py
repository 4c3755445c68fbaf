"""Fail-closed checks on device tensors that a caller may read back together, each still raising its own error.

Outside :func:`deferred`, :func:`fail_if` reads its flag back at once (one host sync per check) and raises where
the check is. Inside, it hands the flag and its error to the block's sink instead; the sink's owner reads every
flag back together with its own (one sync) and raises the error of the *first* failed check in the order they were
made: the error the immediate checks would have raised, since the code between them does not wait for the
device. Code after a failed deferred check runs on invalid values, so the owner must use none of its results
before the read-back (:class:`kvcert.cache.buffer.WriteBatch` stores nothing before it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

#: receives a deferred check: its 0-dim bool flag (True: failed) and the error to raise then
Sink = Callable[[torch.Tensor, Callable[[], Exception]], None]
_SINK: ContextVar[Sink | None] = ContextVar("kvcert_deferred_checks", default=None)


def fail_if(bad: torch.Tensor, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` when the 0-dim bool tensor ``bad`` is True: now, or inside :func:`deferred` when the
    sink's owner reads the checks back."""
    sink = _SINK.get()
    if sink is not None:
        sink(bad, error)
    elif bool(bad):
        raise error()


@contextmanager
def deferred(sink: Sink) -> Iterator[None]:
    """Within the block, :func:`fail_if` hands its checks to ``sink`` instead of reading them back."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)
