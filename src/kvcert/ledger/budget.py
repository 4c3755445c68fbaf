"""Per-request telescoping failure budget (``heterogeneous-memory.md`` §5.1, rule 3).

The ``k``-th probabilistic event of a request spends ``δ_k = δ_req/((k+1)(k+2))`` (from
:func:`kvcert.bounds.budget.telescoping_delta`, rounded down), so after ``n`` events
``Σ δ_k ≤ δ_req(1 − 1/(n+1)) < δ_req`` at any unknown request length. Each request owns its counter.
"""

from __future__ import annotations

import math
from fractions import Fraction

from kvcert.bounds.budget import telescoping_delta

__all__ = ["RequestBudget", "telescoping_delta"]


class RequestBudget:
    """One request's own telescoping counter ``k`` and its exact spend (a sum of the float shares)."""

    def __init__(self, delta_req: float) -> None:
        telescoping_delta(0, delta_req)  # validates delta_req
        self.delta_req = float(delta_req)
        self.k = 0
        self.spent = Fraction(0)

    def next_share(self) -> float:
        """The share the next probabilistic event will spend (does not spend it)."""
        return telescoping_delta(self.k, self.delta_req)

    def spend(self) -> float:
        """Spend ``δ_k`` for the next probabilistic event, advance ``k``, return the share."""
        share = self.next_share()
        self.k += 1
        self.spent += Fraction(share)
        return share

    @property
    def spent_upper(self) -> float:
        """``Σ δ`` as a float rounded up (never below the exact sum)."""
        f = float(self.spent)
        return math.nextafter(f, math.inf) if Fraction(f) < self.spent else f
