"""Per-request telescoping failure budget (``docs/ledger.md#admission-rules``, rule 3).

The ``k``-th probabilistic event of a request spends ``δ_k = δ_req/((k+1)(k+2))`` (from
:func:`kvcert.bounds.budget.telescoping_delta`, rounded down), so after ``n`` events
``Σ δ_k ≤ δ_req(1 − 1/(n+1)) < δ_req`` at any unknown request length. Each request owns its counter.

A read served on a partially certified bound (a Tier-B gate) is charged a fixed share instead
(:meth:`RequestBudget.charge`: ``cells · δ_loc``, the share its certificate was computed at); the cache keeps those
charges within ``δ_req`` itself (``docs/read-path.md#tier-b-gate``), and the budget adds them to what it reports spent.
"""

from __future__ import annotations

import math
import threading
from fractions import Fraction

from kvcert.bounds.budget import telescoping_delta

__all__ = ["RequestBudget", "telescoping_delta"]

_SHARES: dict[float, list[float]] = {}  # δ_req -> [δ_0, δ_1, …], computed once per process (exact rounding is slow)
_SHARES_LOCK = threading.Lock()


def _share(k: int, delta_req: float) -> float:
    """``telescoping_delta(k, delta_req)``, memoised (every account walks the same schedule)."""
    shares = _SHARES.get(delta_req)
    if shares is None or k >= len(shares):
        with _SHARES_LOCK:
            shares = _SHARES.setdefault(delta_req, [])
            while len(shares) <= k:
                shares.append(telescoping_delta(len(shares), delta_req))
    return shares[k]


class RequestBudget:
    """One request's own telescoping counter ``k`` and its exact spend (a sum of the float shares)."""

    def __init__(self, delta_req: float) -> None:
        telescoping_delta(0, delta_req)  # validates delta_req
        self.delta_req = float(delta_req)
        self.k = 0
        self._spent = Fraction(0)  # exact Σ_{i<_summed} δ_i; brought up to k when read
        self._summed = 0
        self._charged = Fraction(0)  # exact Σ cells·δ_loc of the fixed-share charges
        self.charged_cells = 0

    def charge(self, cells: int, delta_loc: float) -> None:
        """Spend ``cells · delta_loc`` exactly (``cells >= 0``, ``0 < delta_loc <= 1``; ``ValueError`` otherwise)."""
        if isinstance(cells, bool) or not isinstance(cells, int) or cells < 0:
            raise ValueError(f"cells must be a non-negative int, got {cells!r}")
        if not 0.0 < delta_loc <= 1.0:
            raise ValueError(f"delta_loc must lie in (0, 1], got {delta_loc!r}")
        self._charged += Fraction(delta_loc) * cells
        self.charged_cells += cells

    def next_share(self) -> float:
        """The share the next probabilistic event will spend (does not spend it)."""
        return _share(self.k, self.delta_req)

    def spend(self) -> float:
        """Spend ``δ_k`` for the next probabilistic event, advance ``k``, return the share."""
        share = self.next_share()
        self.k += 1
        return share

    @property
    def spent(self) -> Fraction:
        """``Σ_{i<k} δ_i`` plus the fixed-share charges, exactly (the float shares summed in rational arithmetic)."""
        while self._summed < self.k:
            self._spent += Fraction(_share(self._summed, self.delta_req))
            self._summed += 1
        return self._spent + self._charged

    @property
    def spent_upper(self) -> float:
        """``Σ δ`` as a float rounded up (never below the exact sum)."""
        exact = self.spent
        f = float(exact)
        return math.nextafter(f, math.inf) if Fraction(f) < exact else f
