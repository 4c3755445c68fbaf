"""Failure-budget splits for probabilistic (Tier-B) certificates (``docs/math.md#failure-budgets``).

Each returned share is rounded **down** to a float, so any finite sum of shares never exceeds the
exact-arithmetic total and the union bound stays request-sound. [Lean L3 ``request_budget_sound``]
"""

from __future__ import annotations

import math
from fractions import Fraction


def _check_delta(delta_req: float) -> Fraction:
    if not (math.isfinite(delta_req) and 0.0 < delta_req <= 1.0):
        raise ValueError(f"delta_req must lie in (0, 1], got {delta_req}")
    return Fraction(delta_req)


def _divide_down(delta: Fraction, denominator: int) -> float:
    """``float(delta/denominator)`` rounded toward zero (never above the exact quotient)."""
    exact = delta / denominator
    share = float(exact)
    return math.nextafter(share, 0.0) if Fraction(share) > exact else share


def uniform_split(delta_req: float, layers: int, heads: int, steps: int) -> float:
    """Per-cell share ``δ_loc = δ_req/(L·H·T)``; the union over all ``L·H·T`` cells fails w.p. ≤ ``δ_req``."""
    for name, n in (("layers", layers), ("heads", heads), ("steps", steps)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # a fractional count would under-split δ_req
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    return _divide_down(_check_delta(delta_req), layers * heads * steps)


def telescoping_delta(k: int, delta_req: float) -> float:
    """Step-``k`` share ``δ_k = δ_req/((k+1)(k+2))`` for an unknown horizon (``k = 0, 1, 2, …``).

    ``Σ_{k<n} δ_k = δ_req(1 − 1/(n+1)) < δ_req`` for every ``n`` (telescoping ``1/(k+1) − 1/(k+2)``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:  # the telescoping sum runs over integer steps
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    return _divide_down(_check_delta(delta_req), (k + 1) * (k + 2))
