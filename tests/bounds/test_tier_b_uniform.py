"""The uniform-law Tier-B radius (``docs/math.md#tier-b-uniform``): the ψ bound at 50 digits, exact tails of one and
two uniform channels, Monte-Carlo coverage, and never above the union radius."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from bounds_stats import binomial_sf
from test_radii_tier_b import simulate_eps

from kvcert.bounds import radii, tier_b_radius, tier_b_radius_uniform, tier_b_sigma2
from kvcert.bounds.radii import UNIFORM_CHANNELS, psi_upper

F64 = torch.float64
D, GROUP = 64, 32
SC = D**-0.5
mpmath.mp.dps = 50

#: ψ's arguments checked: both sides of the switch at 1/2, tiny and huge ones
GRID = sorted({*(10.0 ** (k / 8) for k in range(-64, 25)), 0.5, math.nextafter(0.5, 0.0), 0.4999, 0.5001})


def psi_exact(y: float) -> mpmath.mpf:
    x = mpmath.mpf(y)
    return mpmath.log(mpmath.sinh(x) / x)


def test_psi_upper_is_above_psi_and_close_to_it():
    got = psi_upper(torch.tensor(GRID, dtype=F64)).tolist()
    for y, g in zip(GRID, got, strict=True):
        exact = psi_exact(y)
        assert mpmath.mpf(g) >= exact, y
        assert mpmath.mpf(g) <= exact * (1 + mpmath.mpf(1e-5)) + mpmath.mpf(1e-300), y  # and no loose stand-in


def test_the_sixth_order_term_is_needed():
    """``y²/6 − y⁴/180`` alone is below ψ (the expansion alternates): the bound needs its ``y⁶`` term."""
    y = 0.4
    assert mpmath.mpf(y**2 / 6 - y**4 / 180) < psi_exact(y) <= mpmath.mpf(y**2 / 6 - y**4 / 180 + y**6 / 2835)


def _one_hot(n: int, channels: list[int], gen: torch.Generator) -> torch.Tensor:
    q = torch.zeros(n, D, dtype=F64)
    q[:, channels] = torch.rand(n, len(channels), generator=gen, dtype=F64) * 4 + 0.1
    return q


def _two_uniform_tail(x: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
    """``P(|a1·U1 + a2·U2| > x)`` for independent ``U[−1, 1]`` and ``a1 ≥ a2 ≥ 0`` (trapezoid density)."""
    near = (a1 - x) / a1  # x ≤ a1 − a2: the flat part
    far = (a1 + a2 - x).clamp(min=0.0).square() / (4 * a1 * a2)
    return torch.where(x <= a1 - a2, near, far)


@pytest.mark.parametrize("delta", [0.5, 1e-3, 1e-7])
def test_radius_holds_the_exact_tail_of_one_channel(delta):
    gen = torch.Generator().manual_seed(1)
    q = _one_hot(8, [5], gen)
    steps = torch.rand(8, 16, D // GROUP, generator=gen, dtype=F64) * 2
    s = steps.shape[1]
    x = tier_b_radius_uniform(q, steps, SC, s, delta, GROUP)  # [8, S]
    a = SC * q[:, 5:6] * steps[..., 0] / 2
    tail = (1 - x / a).clamp(min=0.0)  # P(|a·U| > x)
    assert bool((tail <= delta / s).all())
    assert bool((x < tier_b_radius(tier_b_sigma2(q, steps, SC, GROUP), s, delta)).all())  # and tighter


@pytest.mark.parametrize("delta", [0.5, 1e-3, 1e-7])
def test_radius_holds_the_exact_tail_of_two_channels(delta):
    gen = torch.Generator().manual_seed(2)
    q = _one_hot(8, [3, 40], gen)  # one channel in each group: unequal weights
    steps = torch.rand(8, 16, D // GROUP, generator=gen, dtype=F64) * 2
    s = steps.shape[1]
    x = tier_b_radius_uniform(q, steps, SC, s, delta, GROUP)
    w = torch.stack([SC * q[:, 3:4] * steps[..., 0] / 2, SC * q[:, 40:41] * steps[..., 1] / 2])
    a1, a2 = w.amax(0), w.amin(0)
    assert bool((_two_uniform_tail(x, a1, a2) <= delta / s).all())


def _irwin_hall_two_sided(n: int, z: float) -> mpmath.mpf:
    """``P(|U_1 + … + U_n| > z)`` for independent ``U[−1, 1]``: twice the Irwin–Hall upper tail, at 200 digits."""
    with mpmath.workdps(200):
        y = (mpmath.mpf(z) + n) / 2  # Σ (U_i + 1)/2 is Irwin–Hall(n)
        if y >= n:
            return mpmath.mpf(0)
        cdf = mpmath.fsum((-1) ** k * mpmath.binomial(n, k) * (y - k) ** n for k in range(int(y) + 1))
        return 2 * (1 - cdf / mpmath.factorial(n))


@pytest.mark.parametrize("delta", [1e-3, 1e-7])
def test_radius_holds_the_exact_tail_of_every_channel_alike(delta):
    """All 64 channels alike: 16 enter through ψ, 48 through ``y²/6``; the exact (Irwin–Hall) tail at the radius is at
    most ``δ_loc`` for one token, and within a factor 100 of it (the bound is Chernoff's, not a loose stand-in)."""
    q = torch.ones(D, dtype=F64)
    steps = torch.full((1, D // GROUP), 0.3, dtype=F64)
    x = float(tier_b_radius_uniform(q, steps, SC, 1, delta, GROUP)[0])
    a = SC * 0.3 / 2
    tail = _irwin_hall_two_sided(D, x / a)
    assert tail <= delta
    assert tail >= delta / 100


@pytest.mark.parametrize("heavy", [0, 3, 24])
def test_monte_carlo_coverage_at_most_delta(heavy):
    """``P(∃t: |ε_t| > x_t) ≤ δ_loc`` by simulation at a large ``δ_loc``, with ``heavy`` channels carrying most of the
    query (fewer and more than :data:`UNIFORM_CHANNELS`); shrinking the radii by a tenth must fail the test."""
    gen = torch.Generator().manual_seed(7 + heavy)
    q = torch.randn(D, generator=gen, dtype=F64) * 0.2
    q[torch.randperm(D, generator=gen)[:heavy]] *= 20
    steps = torch.rand(4, D // GROUP, generator=gen, dtype=F64) + 0.5
    delta, trials = 0.2, 200_000
    x = tier_b_radius_uniform(q, steps, SC, 4, delta, GROUP)
    eps = simulate_eps(q, steps, SC, trials, gen)
    fails = int((eps.abs() > x).any(-1).sum())
    assert binomial_sf(fails, trials, delta) > 1e-6, fails
    shrunk = int((eps.abs() > 0.9 * x).any(-1).sum())
    assert fails < shrunk  # the radii are close enough to the tail for the check to bite


def test_never_above_the_union_radius_and_tighter_on_heavy_channels():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 9, D, generator=gen, dtype=F64)
    steps = torch.rand(6, 1, 50, 1, generator=gen, dtype=F64).expand(-1, -1, -1, D // GROUP)  # one step per token
    union = tier_b_radius(tier_b_sigma2(q, steps, SC, GROUP), 50, 1e-7)
    x = tier_b_radius_uniform(q, steps, SC, 50, 1e-7, GROUP)
    assert x.shape == union.shape == (6, 9, 50)
    assert bool((x <= union).all())
    q_heavy = q.clone()
    q_heavy[..., :2] = 30.0  # two channels carry the query
    union_h = tier_b_radius(tier_b_sigma2(q_heavy, steps, SC, GROUP), 50, 1e-7)
    ratio = tier_b_radius_uniform(q_heavy, steps, SC, 50, 1e-7, GROUP) / union_h
    assert float(ratio.max()) < 0.8


def test_broadcast_rows_equal_one_at_a_time():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 5, D, generator=gen, dtype=F64)
    steps = torch.rand(3, 1, 20, D // GROUP, generator=gen, dtype=F64)
    whole = tier_b_radius_uniform(q, steps, SC, 20, 1e-5, GROUP)
    for i in range(3):
        for m in range(5):
            one = tier_b_radius_uniform(q[i, m], steps[i, 0], SC, 20, 1e-5, GROUP)
            torch.testing.assert_close(whole[i, m], one, rtol=1e-12, atol=0.0)


def test_zero_steps_and_bypassed_channels_give_zero():
    q = torch.randn(D, dtype=F64)
    steps = torch.rand(5, D // GROUP, dtype=F64)
    steps[2] = 0.0  # an exact token
    x = tier_b_radius_uniform(q, steps, SC, 5, 1e-7, GROUP)
    assert float(x[2]) == 0.0 and bool((x[[0, 1, 3, 4]] > 0).all())
    assert bool((tier_b_radius_uniform(q, steps, SC, 5, 1e-7, GROUP, torch.zeros(D)) == 0).all())


def test_heavy_channels_beyond_the_kept_set_stay_sound():
    """More heavy channels than :data:`UNIFORM_CHANNELS`: the rest enter through ``y²/6`` and the radius is still
    at most the union one (and positive)."""
    q = torch.ones(D, dtype=F64)
    q[: UNIFORM_CHANNELS + 8] = 10.0
    steps = torch.full((3, D // GROUP), 0.1, dtype=F64)
    x = tier_b_radius_uniform(q, steps, SC, 3, 1e-7, GROUP)
    union = tier_b_radius(tier_b_sigma2(q, steps, SC, GROUP), 3, 1e-7)
    assert bool((x > 0).all() & (x <= union).all())


def test_bad_inputs_are_refused():
    q, steps = torch.randn(D, dtype=F64), torch.rand(4, D // GROUP, dtype=F64)
    with pytest.raises(ValueError, match="non-finite"):
        tier_b_radius_uniform(q * math.nan, steps, SC, 4, 1e-7, GROUP)
    with pytest.raises(ValueError, match="steps"):
        tier_b_radius_uniform(q, -steps, SC, 4, 1e-7, GROUP)
    with pytest.raises(ValueError, match="n_tokens"):
        tier_b_radius_uniform(q, steps, SC, 3, 1e-7, GROUP)
    with pytest.raises(ValueError, match="delta_loc"):
        tier_b_radius_uniform(q, steps, SC, 4, 0.0, GROUP)
    with pytest.raises(ValueError, match="scale"):
        tier_b_radius_uniform(q, steps, -1.0, 4, 1e-7, GROUP)


def test_the_table_reads_psi_from_above_and_close(monkeypatch):
    """Many tokens go through the per-query table of ψ sums (points at or above each argument): never below the direct
    evaluation, and within 2 % of it."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(3, D, generator=gen, dtype=F64)
    q[:, :3] *= 10
    spread = torch.logspace(-2, 1, 400, dtype=F64).view(1, -1, 1)  # steps over three orders of magnitude
    steps = torch.rand(3, 400, D // GROUP, generator=gen, dtype=F64) * spread
    table = tier_b_radius_uniform(q, steps, SC, 400, 1e-7, GROUP)
    monkeypatch.setattr(radii, "UNIFORM_TABLE", 10**9)  # every argument evaluated directly
    direct = tier_b_radius_uniform(q, steps, SC, 400, 1e-7, GROUP)
    assert bool((table >= direct).all())
    assert float((table / direct).max()) < 1.02
