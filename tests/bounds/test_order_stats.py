"""The order-statistics box (``kvcert.bounds.order_stats``): the exceedance counts hold their tail budget against the
exact binomial, and the bound holds the exact TV in every cell whose errors obey the event it assumes, including the
cells where the counted exceptions sit on the heaviest tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binom

from kvcert.bounds import true_tv, tv_box
from kvcert.bounds.order_stats import LEVELS, binomial_count, exceedance_counts, order_stat_box

F64 = torch.float64


@pytest.mark.parametrize("n", [1, 7, 100, 2048, 32768])
@pytest.mark.parametrize("prob", [1e-9, 1e-4, 0.011, 0.27, 0.9])
@pytest.mark.parametrize("delta", [0.5, 1e-3, 1e-8])
def test_binomial_count_holds_its_tail(n: int, prob: float, delta: float) -> None:
    k = binomial_count(n, prob, delta)
    assert 0 <= k <= n
    assert binom.sf(k, n, prob) <= delta  # P(Bin > k), exact
    # and it is a Chernoff quantile, not a trivial one: within a few deviations of the exact quantile
    exact = int(binom.isf(delta, n, prob))
    assert k <= max(2 * exact + 40, 5)


def test_binomial_count_edges_and_errors() -> None:
    assert binomial_count(10, 0.0, 0.1) == 0
    assert binomial_count(10, 1.0, 0.1) == 10
    assert binomial_count(0, 0.3, 0.1) == 0
    for bad in ((-1, 0.1, 0.1), (10, 1.5, 0.1), (10, 0.1, 0.0), (10, 0.1, 1.0), (True, 0.1, 0.1)):
        with pytest.raises(ValueError):
            binomial_count(*bad)


def test_exceedance_counts_split_the_budget() -> None:
    n, delta = 2048, 1e-7
    counts = exceedance_counts(n, delta)
    assert len(counts) == len(LEVELS)
    assert list(counts) == sorted(counts, reverse=True)  # higher levels, fewer exceedances
    total = sum(binom.sf(k, n, min(1.0, 2 * math.exp(-z * z / 2))) for k, z in zip(counts, LEVELS, strict=True))
    assert total <= delta
    with pytest.raises(ValueError, match="levels"):
        exceedance_counts(n, delta, (3.0, 2.0))


def _cell(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    s = draw(st.integers(2, 40))
    logits = torch.tensor(draw(st.lists(st.floats(-8.0, 8.0), min_size=s, max_size=s)), dtype=F64)
    sigma = 10.0 ** draw(st.floats(-3.0, 0.0)) * torch.tensor(
        draw(st.lists(st.floats(0.2, 1.0), min_size=s, max_size=s)), dtype=F64
    )
    slack = torch.full((s,), draw(st.sampled_from([0.0, 1e-6, 1e-3])), dtype=F64)
    radius = sigma * draw(st.floats(4.0, 12.0)) + slack
    return torch.softmax(logits, -1), radius, sigma, slack


def _adversarial_errors(
    p: torch.Tensor,
    radius: torch.Tensor,
    sigma: torch.Tensor,
    slack: torch.Tensor,
    counts: list[int],
    signs: torch.Tensor,
) -> torch.Tensor:
    """Errors on the event, as large as it allows on the heaviest tokens: the ``k_j`` heaviest tokens reach the
    next level (the last ones the radius), the rest stay at ``z_0·σ + slack``; signs given per token."""
    order = p.argsort(descending=True)
    mag = torch.minimum(LEVELS[0] * sigma + slack, radius)
    ends = [*LEVELS[1:], math.inf]
    for k, z_next in zip(counts, ends, strict=True):
        top = order[: min(k, p.numel())]
        cap = radius[top] if math.isinf(z_next) else torch.minimum(z_next * sigma[top] + slack[top], radius[top])
        mag[top] = torch.maximum(mag[top], cap)
    return signs * mag


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_bound_holds_on_the_event(data: st.DataObject) -> None:
    p, radius, sigma, slack = _cell(data.draw)
    s = p.numel()
    counts = sorted(data.draw(st.lists(st.integers(0, s), min_size=len(LEVELS), max_size=len(LEVELS))), reverse=True)
    bound = float(order_stat_box(p, radius, sigma, slack, counts))
    signs = torch.tensor(data.draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=s, max_size=s)), dtype=F64)
    worst = _adversarial_errors(p, radius, sigma, slack, counts, signs)
    # a random draw on the event too: each level's exceedances among the heaviest allowed
    frac = torch.tensor(data.draw(st.lists(st.floats(0.0, 1.0), min_size=s, max_size=s)), dtype=F64)
    for err in (worst, worst * frac):
        exact = torch.softmax(torch.log(p) + err, -1)
        assert float(true_tv(exact, p)) <= bound + 1e-12


def test_exceptions_are_paid_for() -> None:
    """One heavy token past the base level: the box over the base radii alone is violated, the bound is not."""
    p = torch.tensor([0.5] + [0.5 / 30] * 30, dtype=F64)
    sigma = torch.full((31,), 0.05, dtype=F64)
    slack = torch.zeros(31, dtype=F64)
    radius = sigma * 8.0
    counts = [1] + [1] * (len(LEVELS) - 1)
    err = torch.full((31,), -LEVELS[0] * 0.05, dtype=F64)
    err[0] = radius[0]  # the heavy token raised to its radius, every other token lowered at the base level
    exact = torch.softmax(torch.log(p) + err, -1)
    tv = float(true_tv(exact, p))
    base_only = float(tv_box(p, torch.minimum(LEVELS[0] * sigma + slack, radius)))
    assert tv > base_only  # without the exceptions' term the bound would fail here
    assert tv <= float(order_stat_box(p, radius, sigma, slack, counts))


def test_no_exceptions_is_the_base_box_and_never_above_the_radius_box() -> None:
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 50, generator=gen, dtype=F64) * 2, -1)
    sigma = torch.rand(4, 50, generator=gen, dtype=F64) * 0.1
    slack = torch.full_like(sigma, 1e-6)
    radius = 7.0 * sigma + slack
    zero = order_stat_box(p, radius, sigma, slack, [0] * len(LEVELS))
    assert torch.allclose(zero, tv_box(p, torch.minimum(LEVELS[0] * sigma + slack, radius)), rtol=1e-12)
    full = order_stat_box(p, radius, sigma, slack, [50] * len(LEVELS))  # every token may be an exception
    assert (full >= tv_box(p, radius) * (1 - 1e-12)).all()


def test_bad_input_is_named() -> None:
    p = torch.full((4,), 0.25, dtype=F64)
    ok = torch.full((4,), 0.1, dtype=F64)
    counts = [1] * len(LEVELS)
    with pytest.raises(ValueError, match="sigma"):
        order_stat_box(p, ok, ok * float("nan"), ok, counts)
    with pytest.raises(ValueError, match="radius"):
        order_stat_box(p, -ok, ok, ok, counts)
    with pytest.raises(ValueError, match="counts"):
        order_stat_box(p, ok, ok, ok, counts[:-1])
    with pytest.raises(ValueError, match="broadcast"):
        order_stat_box(p, torch.full((3,), 0.1, dtype=F64), ok, ok, counts)


def test_an_exception_on_a_light_token_pays_the_base_box_twice() -> None:
    """A light token raised past its base level also gained weight from the base errors (``p̂ = p̃e^{ℓ_b}/Σp̃e^{−ℓ_b}``):
    with ``p̃`` in place of ``p̂`` the exception's term would miss ``(e^{2ℓ_b} − 1)(e^{w} − 1)·p̃``."""
    p = torch.tensor([0.005, 0.995], dtype=F64)
    sigma = torch.tensor([0.5, 0.0], dtype=F64)  # the heavy token is exact: the exception can only be the light one
    slack = torch.zeros(2, dtype=F64)
    radius = 8.0 * sigma
    level = (LEVELS[0],)  # one level, one base: the bound is the base box plus the exception's term
    err = torch.tensor([float(radius[0]), 0.0], dtype=F64)
    tv = float(true_tv(torch.softmax(torch.log(p) + err, -1), p))
    base = torch.minimum(LEVELS[0] * sigma + slack, radius)
    unweighted = float(tv_box(p, base)) + float(p[0] * torch.expm1(radius[0] - base[0]))
    assert tv > unweighted
    assert tv <= float(order_stat_box(p, radius, sigma, slack, [1], level))


def test_the_logit_slack_widens_every_level() -> None:
    """Errors of the computed logits reach ``z·σ_t + slack_t``: a level without the slack would be violated."""
    p = torch.tensor([0.5, 0.5], dtype=F64)
    sigma = torch.full((2,), 0.01, dtype=F64)
    slack = torch.full((2,), 0.3, dtype=F64)
    radius = 8.0 * sigma + slack
    err = torch.tensor([1.0, -1.0], dtype=F64) * (LEVELS[0] * 0.01 + 0.3)
    tv = float(true_tv(torch.softmax(torch.log(p) + err, -1), p))
    assert tv > float(tv_box(p, LEVELS[0] * sigma))
    assert tv <= float(order_stat_box(p, radius, sigma, slack, [0] * len(LEVELS)))


def test_overflowing_radii_give_the_trivial_bound_never_nan() -> None:
    """Radii past the float64 range of ``e^c`` (about 709): the bound is at most 1 and never NaN, also where a token
    of zero served weight has such a radius, or two levels overflow at once."""
    counts = [1] * len(LEVELS)
    cases = [
        (torch.tensor([1.0, 0.0]), torch.tensor([1.0, 800.0]), torch.tensor([0.1, 0.1])),
        (torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 1.0, 720.0]), torch.full((3,), 0.1)),
        (torch.tensor([0.5, 0.5]), torch.full((2,), 1e4), torch.full((2,), 1000.0)),
    ]
    for p, radius, sigma in cases:
        p, radius, sigma = p.to(F64), radius.to(F64), sigma.to(F64)
        bound = order_stat_box(p, radius, sigma, torch.zeros_like(p), counts)
        assert torch.isfinite(bound) and float(bound) <= 1.0
        assert float(bound) >= float(tv_box(p, radius)) * (1 - 1e-12)
