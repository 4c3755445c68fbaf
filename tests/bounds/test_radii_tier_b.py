"""Tier B (subtractive dither): variance proxy formula and Monte Carlo coverage P(any |ε_t| > u_t) ≤ δ_loc."""

from __future__ import annotations

import math

import pytest
import torch
from bounds_stats import binomial_sf

from kvcert.bounds import tier_b_radius, tier_b_sigma2, tv_meter

F64 = torch.float64
D, GROUP = 64, 32


def simulate_eps(
    q: torch.Tensor,
    steps: torch.Tensor,
    scale: float,
    trials: int,
    gen: torch.Generator,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """ε_t = scale·Σ_c q_c r_{t,c}, r ~ U[−s/2, s/2] per channel (exact channels: r = 0) -> [trials, S]."""
    s_full = steps.repeat_interleave(GROUP, dim=-1)  # [S, D]
    if mask is not None:
        s_full = s_full * mask
    r = (torch.rand(trials, *s_full.shape, generator=gen, dtype=F64) - 0.5) * s_full
    return scale * (r * q).sum(-1)


def coverage_failures(q, steps, scale, delta, trials, gen, shrink=1.0, mask=None) -> int:
    sigma2 = tier_b_sigma2(q, steps, scale, GROUP, mask)
    u = tier_b_radius(sigma2, steps.shape[0], delta) * shrink
    eps = simulate_eps(q, steps, scale, trials, gen, mask)
    return int((eps.abs() > u).any(-1).sum())


def test_sigma2_matches_per_channel_formula_and_empirical_variance():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(D, generator=gen, dtype=F64)
    steps = torch.rand(5, D // GROUP, generator=gen, dtype=F64)
    scale = D**-0.5
    sigma2 = tier_b_sigma2(q, steps, scale)
    brute = scale**2 / 12 * (q**2 * steps.repeat_interleave(GROUP, -1) ** 2).sum(-1)
    torch.testing.assert_close(sigma2, brute, rtol=1e-13, atol=0)
    eps = simulate_eps(q, steps, scale, 40_000, gen)
    # uniform variance is exactly s²/12; the sample variance has relative s.e. ≈ sqrt(2/40000) ≈ 0.7%
    torch.testing.assert_close(eps.var(0), sigma2, rtol=0.05, atol=0)


def test_channel_mask_removes_bypassed_channels():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, D, generator=gen, dtype=F64)
    steps = torch.rand(3, 7, D // GROUP, generator=gen, dtype=F64)
    mask = (torch.rand(D, generator=gen) < 0.7).to(F64)
    torch.testing.assert_close(tier_b_sigma2(q, steps, 0.1, GROUP, mask), tier_b_sigma2(q * mask, steps, 0.1, GROUP))
    assert tier_b_sigma2(q, steps, 0.1).shape == (3, 7)
    with pytest.raises(ValueError, match="channel_mask"):
        tier_b_sigma2(q, steps, 0.1, GROUP, torch.full((D,), 0.5))


@pytest.mark.parametrize("n_tokens", [1, 16])
def test_monte_carlo_coverage_at_most_delta(n_tokens):
    gen = torch.Generator().manual_seed(3 + n_tokens)
    delta, trials, scale = 0.05, 6000, D**-0.5
    q = torch.randn(D, generator=gen, dtype=F64) * 2  # fixed (non-adaptive) query
    steps = torch.rand(n_tokens, D // GROUP, generator=gen, dtype=F64) + 0.01
    mask = torch.ones(D, dtype=F64)
    mask[:8] = 0  # four bypassed pairs stay exact
    failures = coverage_failures(q, steps, scale, delta, trials, gen, mask=mask)
    # one-sided binomial test: reject "failure rate <= δ" only at p < 1e-6
    assert binomial_sf(failures, trials, delta) > 1e-6, failures
    # power check: the same test rejects a radius that is too small (u/2), so it can fail
    too_small = coverage_failures(q, steps, scale, delta, trials, gen, shrink=0.5, mask=mask)
    assert binomial_sf(too_small, trials, delta) < 1e-6, too_small


def test_tier_b_certificate_holds_outside_the_failure_event():
    gen = torch.Generator().manual_seed(9)
    n, delta, trials = 32, 0.05, 2000
    q = torch.randn(D, generator=gen, dtype=F64)
    steps = torch.rand(n, D // GROUP, generator=gen, dtype=F64) * 0.5
    u = tier_b_radius(tier_b_sigma2(q, steps, D**-0.5), n, delta)
    p = torch.softmax(torch.randn(n, generator=gen, dtype=F64) * 3, -1)
    eps = simulate_eps(q, steps, D**-0.5, trials, gen)
    inside = (eps.abs() <= u).all(-1)
    tv = 0.5 * (torch.softmax(torch.log(p) - eps, -1) - p).abs().sum(-1)
    cert = tv_meter(p.expand(trials, n), u.expand(trials, n))
    assert bool((tv[inside] <= cert[inside] + 1e-12).all())
    assert binomial_sf(int((tv > cert + 1e-12).sum()), trials, delta) > 1e-6


def test_tier_b_radius_formula_and_bad_inputs():
    u = tier_b_radius(torch.tensor([0.0, 1.0, 4.0], dtype=F64), 100, 1e-3)
    torch.testing.assert_close(u, torch.sqrt(2 * torch.tensor([0.0, 1.0, 4.0], dtype=F64) * math.log(2e5)))
    with pytest.raises(ValueError, match="delta_loc"):
        tier_b_radius(torch.ones(2), 2, 0.0)
    with pytest.raises(ValueError, match="n_tokens"):
        tier_b_radius(torch.ones(2), 0, 0.1)
    with pytest.raises(ValueError, match="n_tokens"):
        tier_b_radius(torch.ones(2), 2.0, 0.1)


def test_tier_b_radius_refuses_a_union_over_fewer_tokens_than_it_covers():
    """A count below the tokens of ``sigma2`` would shrink the union's log factor (and the radius) without paying for
    the other tokens' tails: refused by name. Counting more tokens (a window wider than the proxy's broadcast) only
    widens the radius, and a count equal to the width is the sound union."""
    sigma2 = torch.ones(3, 8, dtype=F64)
    with pytest.raises(ValueError, match="n_tokens=2 is below the 8 tokens"):
        tier_b_radius(sigma2, 2, 0.1)
    assert (tier_b_radius(sigma2, 16, 0.1) > tier_b_radius(sigma2, 8, 0.1)).all()
    torch.testing.assert_close(
        tier_b_radius(sigma2, 8, 0.1), torch.full((3, 8), math.sqrt(2 * math.log(160.0)), dtype=F64)
    )
    with pytest.raises(ValueError, match="sigma2"):
        tier_b_radius(torch.tensor([-1.0]), 2, 0.1)
    with pytest.raises(ValueError, match="steps"):
        tier_b_sigma2(torch.ones(D), -torch.ones(3, 2), 0.1)
    with pytest.raises(ValueError, match="group_size"):
        tier_b_sigma2(torch.ones(D), torch.ones(3, 2), 0.1, group_size=48)
    with pytest.raises(ValueError, match="q"):
        tier_b_sigma2(torch.full((D,), math.nan), torch.ones(3, 2), 0.1)
