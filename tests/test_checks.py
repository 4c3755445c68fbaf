"""kvcert.checks: :func:`fail_if` at once or deferred, :class:`Checks`, the sink that reads a block's checks back
with its owner's values in one sync, :func:`read_back`, and :func:`lockstep`, which reads back the rounds of several
computations together."""

from __future__ import annotations

import pytest
import torch

from kvcert import checks as checks_module
from kvcert.checks import Checks, Steps, deferred, fail_if, lockstep, read_back


def test_checks_read_back_values_and_raise_the_first_failed_check_in_order():
    checks = Checks()
    with deferred(checks):
        fail_if(torch.tensor(False), lambda: ValueError("never"))
        fail_if(torch.tensor(True), lambda: ValueError("first"))
        fail_if(torch.tensor(True), lambda: ValueError("second"))
    with pytest.raises(ValueError, match="first"):
        checks.read_back([torch.ones(2, 3, dtype=torch.bool)])
    assert checks.read_back() == []  # the checks were cleared: nothing left to read or raise


def test_checks_return_the_values_flattened_in_order_when_every_check_passes():
    checks = Checks()
    with deferred(checks):
        fail_if(torch.tensor(False), lambda: ValueError("never"))
    need = torch.tensor([[True, False], [False, True]])
    back = checks.read_back([need, torch.tensor([7, 8, 9])], guard=torch.tensor(True))
    assert back == [1, 0, 0, 1, 7, 8, 9]


def test_a_false_guard_drops_the_checks_and_returns_none():
    """A block that ran outside its domain (``guard`` False: e.g. a non-finite query) is redone by its owner: its
    failed checks, made on those values, raise nothing."""
    checks = Checks()
    with deferred(checks):
        fail_if(torch.tensor(True), lambda: ValueError("made on invalid values"))
    assert checks.read_back([torch.tensor([1])], guard=torch.tensor(False)) is None
    assert checks.read_back() == []


def test_nested_blocks_send_each_check_to_the_innermost_sink():
    outer, inner = Checks(), Checks()
    with deferred(outer):
        with deferred(inner):
            fail_if(torch.tensor(True), lambda: ValueError("inner"))
        fail_if(torch.tensor(True), lambda: ValueError("outer"))
    with pytest.raises(ValueError, match="inner"):
        inner.read_back()
    with pytest.raises(ValueError, match="outer"):
        outer.read_back()
    with pytest.raises(ValueError, match="now"):  # outside every block a check reads back at once
        fail_if(torch.tensor(True), lambda: ValueError("now"))


def test_read_back_returns_ints_and_inside_a_checks_block_raises_the_failed_check_first():
    assert read_back([torch.tensor([True, False]), torch.tensor([[3], [4]])]) == [1, 0, 3, 4]
    checks = Checks()
    with deferred(checks):
        fail_if(torch.tensor(False), lambda: ValueError("never"))
        assert read_back([torch.tensor([5])]) == [5]
        fail_if(torch.tensor(True), lambda: ValueError("pending"))
        with pytest.raises(ValueError, match="pending"):
            read_back([torch.tensor([6])])


def _rounds(n: int, start: int, log: list[tuple[int, list[int]]]) -> Steps[int]:
    """``n`` rounds, each asking for two values (a 0-d and a 2-vector); returns the sum of what it was sent."""
    total = 0
    for r in range(n):
        got = yield [torch.tensor(start + r), torch.tensor([start, -r])]
        log.append((start, got))
        total += sum(got)
    return total


def test_lockstep_reads_every_round_back_once_and_sends_each_computation_its_own_values(monkeypatch):
    """Three computations of 2, 0 and 3 rounds: 3 read-backs (not 5), each computation sent exactly what it asked
    for, in its order, and the results those of running each alone."""
    alone_log: list[tuple[int, list[int]]] = []
    alone = [lockstep([_rounds(n, s, alone_log)])[0] for n, s in ((2, 10), (0, 20), (3, 30))]
    calls = []
    real = checks_module.read_back

    def counting(values):
        calls.append(len(values))
        return real(values)

    monkeypatch.setattr(checks_module, "read_back", counting)
    log: list[tuple[int, list[int]]] = []
    assert lockstep([_rounds(n, s, log) for n, s in ((2, 10), (0, 20), (3, 30))]) == alone
    assert calls == [4, 4, 2]  # rounds 1 and 2: two computations of two tensors each; round 3: one
    assert sorted(log) == sorted(alone_log) and (10, [10, 10, 0]) in log and (30, [32, 30, -2]) in log


def test_a_failed_check_of_a_round_raises_before_any_computation_is_sent_its_values():
    sent = []

    def failing() -> Steps[None]:
        fail_if(torch.tensor(True), lambda: ValueError("in round 1"))
        sent.append((yield [torch.tensor(1)]))

    def other() -> Steps[None]:
        sent.append((yield [torch.tensor(2)]))

    with deferred(Checks()), pytest.raises(ValueError, match="in round 1"):
        lockstep([other(), failing()])
    assert sent == []
