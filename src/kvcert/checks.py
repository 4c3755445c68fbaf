"""Fail-closed checks on device tensors that a caller may read back together, each still raising its own error.

Outside :func:`deferred`, :func:`fail_if` reads its flag back at once (one host sync per check) and raises where
the check is. Inside, it hands the flag and its error to the block's sink instead; the sink's owner reads every
flag back together with its own (one sync) and raises the error of the *first* failed check in the order they were
made: the error the immediate checks would have raised, since the code between them does not wait for the
device. Code after a failed deferred check runs on invalid values, so the owner must use none of its results
before the read-back (:class:`kvcert.cache.buffer.WriteBatch` stores nothing before it). :class:`Checks` is such a
sink: it keeps the checks in order and reads them back together with the owner's own values in one sync.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

T = TypeVar("T")
#: a computation that waits for the device now and then: it yields the integer or bool tensors it needs on the host
#: and is sent them back as Python ints (flattened, concatenated), then returns its result
Steps = Generator[list[torch.Tensor], list[int], T]

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


def read_back(values: Sequence[torch.Tensor]) -> list[int]:
    """``values`` (integer or bool tensors of any shape, flattened and concatenated) as Python ints, in one host
    sync. Inside :func:`deferred` with a :class:`Checks` sink, the checks it holds come back in the same sync and the
    first failed one raises its error before any value is returned (:meth:`Checks.read_back`): code that decides on
    the host only from what this returns never acts on the results of a failed check."""
    sink = _SINK.get()
    if isinstance(sink, Checks):
        back = sink.read_back(values)
        assert back is not None  # no guard: never None
        return back
    return torch.cat([v.reshape(-1).to(torch.int64) for v in values]).tolist()


def lockstep(steps: Sequence[Steps[T]]) -> list[T]:
    """Run :data:`Steps` computations side by side, each round reading back what every unfinished one yielded in one
    :func:`read_back` (the active :class:`Checks` sink's checks with it): ``max`` rounds instead of their sum.
    Returns the results in order. Each computation is sent exactly the values it would be sent run alone, so its
    result is the same as long as none reads state another one changes before it finishes."""
    results: dict[int, T] = {}
    pending: dict[int, list[torch.Tensor]] = {}

    def advance(i: int, values: list[int] | None) -> None:
        try:
            pending[i] = next(steps[i]) if values is None else steps[i].send(values)
        except StopIteration as done:
            results[i] = done.value

    for i in range(len(steps)):
        advance(i, None)
    while pending:
        wanted, round_ = list(pending.items()), []
        pending.clear()
        for _, tensors in wanted:
            round_.extend(tensors)
        back = read_back(round_) if round_ else []
        at = 0
        for i, tensors in wanted:
            n = sum(t.numel() for t in tensors)
            advance(i, back[at : at + n])
            at += n
    return [results[i] for i in range(len(steps))]


class Checks:
    """A :data:`Sink` that keeps the deferred checks of a block in the order they were made, for its owner to read
    back with :meth:`read_back`."""

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[[], Exception]]] = []

    def __call__(self, bad: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Record the check ``bad`` (0-dim bool, True: failed) with its ``error``."""
        self._checks.append((bad, error))

    def read_back(self, values: Sequence[torch.Tensor] = (), guard: torch.Tensor | None = None) -> list[int] | None:
        """Every recorded flag, ``values`` (integer or bool tensors of any shape, flattened and concatenated) and
        ``guard`` in one host sync (none when there is nothing to read), then the recorded checks are cleared.

        ``guard`` (0-dim bool) says whether the block's checks apply at all: False means the block ran outside its
        domain and its owner redoes it another way, so the checks are dropped and ``None`` is returned. Otherwise
        the first failed check (in the order recorded) raises its error, and the values come back as ints."""
        checks, self._checks = self._checks, []
        parts = [bad.reshape(1) for bad, _ in checks] + [v.reshape(-1) for v in values]
        if guard is not None:
            parts.append(guard.reshape(1))
        if not parts:
            return []
        back = torch.cat([x.to(torch.int64) for x in parts]).tolist()  # the one host sync
        if guard is not None and not back.pop():
            return None
        for failed, (_, error) in zip(back, checks, strict=False):
            if failed:
                raise error()
        return back[len(checks) :]
