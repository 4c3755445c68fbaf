"""Sampled sentinel and its detection-latency guarantee (``docs/ledger.md#sampled-sentinel``).

Each round draws ``r`` slots uniformly **with replacement** from the ``M`` written slots and verifies
them against the host tier. With ``B`` bad slots (independent of the sampling) one round misses all of
them with probability ``q = (1 − B/M)^r`` (independent draws), ``n`` independent rounds with ``q^n``, so

    q^n ≤ δ   ⇔   n ≥ ln δ / ln q = ln δ / (r · ln(1 − B/M))        (ln q < 0 flips the inequality)

and ``n(δ) = ⌈ln δ / (r · ln(1 − B/M))⌉`` rounds detect at least one bad slot with probability ≥ 1 − δ.
It is the **smallest** such ``n``: ``q^(n−1) > δ``. The quotient is evaluated in 60-digit decimal arithmetic
(``1 − B/M`` is exact there), so the ceiling is the exact smallest ``n`` also when ``B/M`` is ~1e-12 and a
float ``(1 − B/M)^(r·n)`` would be off by millions of rounds. ``M`` and ``r`` are at most :data:`MAX_COUNT`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal, localcontext

import numpy as np

MAX_COUNT = 1 << 62
"""Largest accepted ``M`` (slots) and ``r`` (draws per round): int64 sampling range."""


def _check(bad: int, total: int, r: int) -> None:
    if not 1 <= total <= MAX_COUNT:
        raise ValueError(f"total (M) must lie in [1, 2^62], got {total}")
    if not 1 <= bad <= total:
        raise ValueError(f"bad (B) must lie in [1, M={total}], got {bad}")
    if not 1 <= r <= MAX_COUNT:
        raise ValueError(f"r must lie in [1, 2^62], got {r}")


def miss_probability(bad: int, total: int, r: int, rounds: int) -> float:
    """``P[no bad slot sampled in `rounds` rounds] = (1 − B/M)^(r·rounds)``."""
    _check(bad, total, r)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    return math.exp(r * rounds * math.log1p(-bad / total)) if bad < total else float(rounds == 0)


def rounds_needed(bad: int, total: int, r: int, delta: float) -> int:
    """Smallest ``n >= 1`` with ``(1 − B/M)^(r·n) ≤ δ``: ``⌈ln δ / (r·ln(1 − B/M))⌉`` (1 when ``B = M``),
    in 60-digit decimal arithmetic (module docstring); ``ValueError`` for arguments out of range."""
    _check(bad, total, r)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if bad == total:
        return 1
    with localcontext() as ctx:
        ctx.prec = 60
        log_q = (1 - Decimal(bad) / Decimal(total)).ln() * r
        quotient = Decimal(delta).ln() / log_q  # both logs < 0
        return max(1, int(quotient.to_integral_value(rounding="ROUND_CEILING")))


def latency_table(
    total: int,
    r: int,
    bads: tuple[int, ...] = (1, 2, 4, 8, 16),
    deltas: tuple[float, ...] = (0.1, 0.01, 0.001),
) -> str:
    """Printable table of ``n(δ)`` over ``B`` × ``δ`` for ``M = total`` slots and ``r`` draws per round."""
    head = f"rounds to detect >=1 of B bad slots (M={total}, r={r}, with replacement)\n"
    head += "B".rjust(5) + "".join(f"delta={d:g}".rjust(14) for d in deltas) + "\n"
    rows = [
        str(b).rjust(5) + "".join(str(rounds_needed(b, total, r, d)).rjust(14) for d in deltas)
        for b in bads
        if b <= total
    ]
    return head + "\n".join(rows)


class SampledSentinel:
    """Each :meth:`round` draws ``r`` of ``population()`` with replacement and returns the bad ones.

    ``verify(slots) -> bool[len(slots)]`` marks slots whose device copy disagrees with the host tier.
    """

    def __init__(
        self,
        population: Callable[[], np.ndarray],
        verify: Callable[[np.ndarray], np.ndarray],
        r: int,
        rng: np.random.Generator,
    ) -> None:
        if r < 1:
            raise ValueError(f"r must be >= 1, got {r}")
        self.population = population
        self.verify = verify
        self.r = r
        self.rng = rng
        self.rounds = 0
        self.n_checked = 0

    def round(self) -> np.ndarray:
        """Verify ``r`` uniformly drawn slots (with replacement); returns the distinct bad slots found."""
        pop = np.asarray(self.population(), dtype=np.int64)
        self.rounds += 1
        if pop.size == 0:
            return np.zeros(0, dtype=np.int64)
        drawn = pop[self.rng.integers(0, pop.size, size=self.r)]
        self.n_checked += self.r
        bad = np.asarray(self.verify(drawn), dtype=bool)
        return np.unique(drawn[bad])
