"""Exact binomial tail for Monte Carlo coverage checks that can fail."""

from __future__ import annotations

import math


def binomial_sf(k: int, n: int, prob: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, prob)``, summed in log space (no overflow for large ``n``)."""
    if k <= 0:
        return 1.0
    log_terms = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(prob)
        + (n - i) * math.log1p(-prob)
        for i in range(k, n + 1)
    ]
    top = max(log_terms)
    return math.exp(top) * sum(math.exp(t - top) for t in log_terms)
