"""The order-statistics box: a Tier-B TV bound that pays the union radius on a counted few tokens only
(``docs/math.md#order-statistics-box``).

Setting of the Tier-B radius (:func:`kvcert.bounds.tier_b_radius`): for one cell, a query independent of the dither
and tokens whose logit errors ``ε_t`` are independent, each sub-Gaussian with proxy ``σ_t²``, so
``P(|ε_t| > z·σ_t) ≤ 2e^{−z²/2}``. The union radius ``u_t`` lets every token reach about ``7σ_t`` at once. But the
tokens past ``z·σ_t`` are few: their count ``N_z`` is a sum of independent indicators, each of probability at most
``π_z = 2e^{−z²/2}``, so it is dominated by ``Bin(n, π_z)`` and stays below a count ``k_z`` except with a small
probability. On the event that every level ``z_j`` of :data:`LEVELS` has ``N_{z_j} ≤ k_j``, the errors lie in a box of
radius ``z_b·σ_t`` but for at most ``k_b`` tokens, and the TV is at most the box over those radii plus what the counted
exceptions can add (:func:`order_stat_box`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from kvcert.bounds.softmax_tv import check_broadcast, check_nonneg_finite, check_served
from kvcert.bounds.tv_box import BoxRows, box_rows, tv_box

F64 = torch.float64
_U = 2.0**-53
#: the multiples ``z`` of ``σ_t`` whose exceedances are counted; ``δ`` is split evenly over them
LEVELS: tuple[float, ...] = (2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0)


def _kl(a: float, p: float) -> float:
    """``KL(Bernoulli(a) ‖ Bernoulli(p))`` in nats, for ``0 < p < 1`` and ``0 ≤ a ≤ 1``."""
    out = 0.0 if a == 0.0 else a * math.log(a / p)
    return out if a == 1.0 else out + (1.0 - a) * math.log((1.0 - a) / (1.0 - p))


@functools.lru_cache(maxsize=4096)
def binomial_count(n: int, prob: float, delta: float) -> int:
    """The least ``k`` with ``P(Bin(n, prob) > k) ≤ delta`` by the Chernoff bound
    ``P(Bin(n, p) ≥ j) ≤ exp(−n·KL(j/n ‖ p))`` (``j ≥ n·p``); ``n`` when no smaller ``k`` is certified that way.

    The Chernoff bound is an upper bound on the tail, so the returned ``k`` is at least the exact quantile: the
    tail beyond it is at most ``delta``. A margin of ``10⁻⁹`` relative in the exponent absorbs rounding."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob must lie in [0, 1], got {prob!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if prob == 0.0:
        return 0
    if prob == 1.0:
        return n
    need = math.log(1.0 / delta) * (1.0 + 1e-9) + 1e-12

    def tail_ok(j: int) -> bool:  # the bound on P(Bin ≥ j) is ≤ delta
        return j >= n * prob and n * _kl(j / n, prob) >= need

    lo, hi = max(1, math.ceil(n * prob)), n + 1  # the bound decreases in j past n·p; j = n + 1 has tail 0
    while lo < hi:
        mid = (lo + hi) // 2
        if tail_ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return min(lo - 1, n)


def exceedance_counts(n: int, delta: float, levels: Sequence[float] = LEVELS) -> tuple[int, ...]:
    """``k_j`` per level ``z_j``: with ``n`` independent tokens, each past ``z_j·σ_t`` with probability at most
    ``π_j = min(1, 2e^{−z_j²/2})``, ``P(∃j: N_{z_j} > k_j) ≤ delta`` (``delta/len(levels)`` per level,
    :func:`binomial_count`, since a sum of independent indicators of probabilities ``≤ π`` is stochastically below
    ``Bin(n, π)``)."""
    _check_levels(levels)
    share = delta / len(levels)
    return tuple(binomial_count(n, min(1.0, 2.0 * math.exp(-z * z / 2.0)), share) for z in levels)


def _check_levels(levels: Sequence[float]) -> None:
    zs = list(levels)
    if (
        not zs
        or any(not math.isfinite(z) or z <= 0 for z in zs)
        or any(b <= a for a, b in zip(zs, zs[1:], strict=False))
    ):
        raise ValueError(f"levels must be positive, finite and strictly increasing, got {zs!r}")


def _topsum(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sum of the ``k`` largest entries of each row of ``x[..., S]`` (all of them when ``k ≥ S``)."""
    if k <= 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    return x.topk(min(k, x.shape[-1]), -1).values.sum(-1)


def order_stat_box(
    p_served: torch.Tensor,
    radius: torch.Tensor,
    sigma: torch.Tensor,
    slack: torch.Tensor,
    counts: Sequence[int],
    levels: Sequence[float] = LEVELS,
    rows: BoxRows = box_rows,
) -> torch.Tensor:
    """``TV(p, p̃) ≤`` this, float64 ``[...]``, on the event that every token obeys ``|s̃_t − s_t| ≤ radius_t`` and,
    for every level ``z_j``, at most ``counts[j]`` tokens have ``|ε_t| > z_j·σ_t``, where ``s̃_t − s_t`` differs from
    ``ε_t`` by at most ``slack_t`` (``docs/math.md#order-statistics-box``).

    Let ``ℓ_{j,t} = min(z_j·σ_t + slack_t, radius_t)`` and ``ℓ_{J,t} = radius_t`` past the last level. For every base
    level ``b``:

    ``TV ≤ tv_box(p̃, ℓ_b) + Σ_{i ≥ b} topsum_{k_i}(p̂_t·(e^{ℓ_{i+1,t} − ℓ_{b,t}} − e^{ℓ_{i,t} − ℓ_{b,t}}))``,

    ``p̂_t = min(1, p̃_t e^{ℓ_{b,t}} / Σ_s p̃_s e^{−ℓ_{b,s}})``, ``topsum_k`` the sum of the ``k`` largest terms over
    the tokens. The least over the base levels is returned, and at most 1. ``p_served[..., S]`` (rows summing to 1),
    ``radius``, ``sigma``, ``slack`` non-negative and finite, broadcastable to it; ``counts`` one per level
    (:func:`exceedance_counts`).
    ``sigma`` must be at least the square root of the Tier-B proxy (a caller that takes a float square root rounds it
    up). Rounding: each level ``z·σ_t + slack_t`` is widened by ``8u``; every exponential by ``8u`` and, for the
    rounding of its argument (a difference ``d`` of two levels, computed within ``u·|d|``), by ``e^{u|d|}``, both in
    the direction that enlarges the bound; each sum by ``(S + 8)u``; the box is
    :func:`~kvcert.bounds.tv_box.tv_box`'s, itself never below its exact value. Radii so large that an exponential
    overflows give a term of ``+∞`` (a token of zero served weight contributes nothing), so such a row gets the
    trivial bound 1, never NaN. ``ValueError`` on non-finite or negative input, shapes that do not broadcast, or a
    count per level missing."""
    _check_levels(levels)
    if len(counts) != len(levels) or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in counts):
        raise ValueError(f"counts must be {len(levels)} non-negative ints (one per level), got {list(counts)!r}")
    p, _ = check_served(p_served)
    m = check_nonneg_finite(radius, "radius")
    sig = check_nonneg_finite(sigma, "sigma")
    phi = check_nonneg_finite(slack, "slack")
    check_broadcast(p_served=p, radius=m, sigma=sig, slack=phi)
    m, sig, phi = (x.to(p.device).expand_as(p) for x in (m, sig, phi))
    s = p.shape[-1]
    up, down = 1.0 + 8 * _U, 1.0 - 8 * _U
    grow = 1.0 + (s + 8) * _U
    ell = [torch.minimum((z * sig + phi) * up, m) for z in levels] + [m]
    weighted = p > 0
    best = torch.full(p.shape[:-1], math.inf, dtype=F64, device=p.device)
    for b in range(len(levels)):
        base = ell[b]
        box = tv_box(p, base, rows=rows)
        norm = (p * torch.exp(-base)).sum(-1, keepdim=True) * down / grow
        # a weight of p' is at most 1; a token of zero served weight has none (no 0·∞ where its radius overflows)
        p_hat = torch.where(weighted, p * torch.exp(base) * up / norm, 0.0).clamp(max=1.0)
        extra = torch.zeros_like(box)
        for i in range(b, len(levels)):
            d_hi, d_lo = (ell[i + 1] - base).clamp(min=0.0), (ell[i] - base).clamp(min=0.0)
            hi = torch.exp(d_hi * (1.0 + _U)) * up
            lo = torch.exp(d_lo * (1.0 - _U)) * down
            inc = torch.where(p_hat > 0, (p_hat * (hi - lo)).nan_to_num(nan=math.inf), 0.0)  # ∞ − ∞: overflow, ∞
            extra = extra + _topsum(inc.clamp(min=0.0), counts[i]) * grow
        best = torch.minimum(best, (box + extra) * (1.0 + 4 * _U))
    return best.clamp(max=1.0)
