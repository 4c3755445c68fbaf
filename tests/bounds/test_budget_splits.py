"""Failure-budget splits: exact telescoping arithmetic, uniform split, shares rounded down."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from kvcert.bounds import telescoping_delta, uniform_split


@pytest.mark.parametrize("delta_req", [1e-2, 0.1, 1e-8, 1.0, 0.3])
def test_telescoping_sum_identity_exact(delta_req):
    d = Fraction(delta_req)
    for n in (1, 2, 3, 10, 257, 2000):
        exact = sum(d / ((k + 1) * (k + 2)) for k in range(n))
        assert exact == d * (1 - Fraction(1, n + 1))  # the identity, in exact rationals
        shares = [Fraction(telescoping_delta(k, delta_req)) for k in range(n)]
        assert all(s <= d / ((k + 1) * (k + 2)) for k, s in enumerate(shares))  # each share rounded down
        total = sum(shares)
        assert total <= exact < d
        assert exact - total <= n * Fraction(2.0**-52) * d  # and only by rounding


def test_telescoping_first_shares():
    assert telescoping_delta(0, 0.01) == 0.01 / 2
    assert telescoping_delta(1, 0.01) <= 0.01 / 6
    assert math.isclose(telescoping_delta(1, 0.01), 0.01 / 6, rel_tol=1e-15)


def test_uniform_split():
    share = uniform_split(1e-2, 30, 9, 256)
    assert Fraction(share) <= Fraction(1e-2) / (30 * 9 * 256)
    assert math.isclose(share, 1e-2 / (30 * 9 * 256), rel_tol=1e-15)
    assert Fraction(share) * 30 * 9 * 256 <= Fraction(1e-2)
    assert uniform_split(0.5, 1, 1, 1) == 0.5


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: uniform_split(0.0, 1, 1, 1), "delta_req"),
        (lambda: uniform_split(1.5, 1, 1, 1), "delta_req"),
        (lambda: uniform_split(float("nan"), 1, 1, 1), "delta_req"),
        (lambda: uniform_split(0.1, 0, 1, 1), "layers"),
        (lambda: uniform_split(0.1, 1, 0, 1), "heads"),
        (lambda: uniform_split(0.1, 1, 1, 0), "steps"),
        (lambda: telescoping_delta(-1, 0.1), "k"),
        (lambda: telescoping_delta(0, -0.1), "delta_req"),
    ],
)
def test_bad_budget_inputs(call, name):
    with pytest.raises(ValueError, match=name):
        call()
