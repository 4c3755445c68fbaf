"""kvcert.checks: :func:`fail_if` at once or deferred, and :class:`Checks`, the sink that reads a block's checks back
with its owner's values in one sync."""

from __future__ import annotations

import pytest
import torch

from kvcert.checks import Checks, deferred, fail_if


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
