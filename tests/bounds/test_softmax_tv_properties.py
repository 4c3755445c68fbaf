"""Test vectors, hypothesis properties, blockwise refinement (``docs/read-path.md#kernel-refinement``), overflow, bad
input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.bounds import (
    FORMS,
    PAPER_LEVEL_FORMS,
    meter_and_unclipped,
    true_tv,
    tv_bound,
    tv_eform,
    tv_meter,
    tv_tail,
    tv_tanh_osc,
    tv_uniform,
)
from kvcert.bounds.softmax_tv import moments, served_meter
from kvcert.checks import Checks, deferred

F64 = torch.float64


# ---------------------------------------------------------------- two-token instance (docs/math.md#retracted-forms)
def test_two_token_vectors():
    p = torch.tensor([0.5, 0.5], dtype=F64)
    c = torch.tensor([0.1, 0.1], dtype=F64)
    eps = torch.tensor([0.1, -0.1], dtype=F64)
    exact = torch.softmax(torch.log(p) - eps, -1)
    expected = {
        "tanh_osc": 0.049958,
        "tanh_max": 0.099668,
        "eform": 0.110701,
        "ptm": 0.110701,
        "two_sided": 0.201336,
        "meter": 0.110701,
    }
    assert true_tv(exact, p).item() == pytest.approx(0.049834, abs=1e-6)
    for form, value in expected.items():
        assert tv_bound(p, c, form).item() == pytest.approx(value, abs=1e-6), form
    assert set(expected) == set(FORMS)
    assert PAPER_LEVEL_FORMS == ("tanh_osc",)


def test_uniform_and_tail_closed_forms():
    assert tv_uniform(0.1).item() == pytest.approx(0.5 * math.expm1(0.2), rel=1e-15)
    assert tv_uniform(torch.tensor([0.0, 5.0])).tolist() == [0.0, 1.0]
    assert tv_uniform(5.0, clip=False).item() == pytest.approx(0.5 * math.expm1(10.0), rel=1e-15)
    assert tv_tail(0.25, 0.1).item() == pytest.approx(0.25 * math.expm1(0.2), rel=1e-15)
    assert tv_tail(0.0, 0.3).item() == 0.0


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(2, 12),
    seed=st.integers(0, 2**31 - 1),
    delta=st.floats(0.0, 4.0),
    extreme=st.booleans(),
)
def test_tail_form_bounds_every_cell(n, seed, delta, extreme):
    """``tv_tail`` per cell (``docs/math.md#tail-form``): errors only on a token set ``T``, ``|ε_t| ≤ Δ`` there, ``α_T``
    the exact mass of ``T``. ``extreme`` puts every error of ``T`` at ``±Δ`` with one sign (the worst case of the
    proof's ``α_T(e^Δ − 1)``, half the form's ``α_T(e^{2Δ} − 1)`` at small ``Δ``)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(n, generator=gen, dtype=F64), -1)
    tail = torch.rand(n, generator=gen) < 0.5
    if extreme:
        eps = torch.full((n,), delta if seed % 2 else -delta, dtype=F64)
    else:
        eps = (2 * torch.rand(n, generator=gen, dtype=F64) - 1) * delta
    eps = torch.where(tail, eps, torch.zeros_like(eps))
    served = torch.softmax(torch.log(p) + eps, -1)
    alpha = min(float(p[tail].sum()), 1.0)  # a float sum of the whole distribution may round above 1
    assert true_tv(p, served).item() <= tv_tail(alpha, delta).item() * (1 + 1e-12) + 1e-15
    assert true_tv(p, served).item() <= alpha * math.expm1(delta) * (1 + 1e-12) + 1e-15  # the proof's tighter form


# ---------------------------------------------------------------- hypothesis properties
def _row(draw_logits: list[float], draw_c: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    n = min(len(draw_logits), len(draw_c))
    p = torch.softmax(torch.tensor(draw_logits[:n], dtype=F64), -1)
    return p, torch.tensor(draw_c[:n], dtype=F64)


logits_st = st.lists(st.floats(-20, 20), min_size=2, max_size=12)
radii_st = st.lists(st.floats(0.0, 8.0), min_size=2, max_size=12)


@settings(max_examples=150, deadline=None)
@given(logits_st, radii_st, st.lists(st.floats(0.0, 2.0), min_size=12, max_size=12))
def test_every_form_monotone_in_radii(logits, radii, extra):
    p, c = _row(logits, radii)
    c2 = c + torch.tensor(extra[: c.numel()], dtype=F64)
    for form in FORMS:
        lo, hi = tv_bound(p, c, form, clip=False), tv_bound(p, c2, form, clip=False)
        assert hi >= lo * (1 - 1e-12) - 1e-15, form


@settings(max_examples=150, deadline=None)
@given(logits_st, radii_st, st.lists(st.floats(-1.0, 1.0), min_size=12, max_size=12))
def test_bound_at_least_true_tv_and_meter_is_min(logits, radii, unit):
    p, c = _row(logits, radii)
    eps = c * torch.tensor(unit[: c.numel()], dtype=F64)
    tv = true_tv(torch.softmax(torch.log(p) - eps, -1), p)
    for form in FORMS:
        assert tv_bound(p, c, form) + 1e-12 >= tv, form
    meter = tv_meter(p, c)
    for form in ("eform", "two_sided", "ptm"):
        assert meter <= tv_bound(p, c, form)


@settings(max_examples=100, deadline=None)
@given(logits_st, st.floats(0.0, 5.0))
def test_constant_radius_collapses_to_uniform(logits, eps):
    p = torch.softmax(torch.tensor(logits, dtype=F64), -1)
    c = torch.full_like(p, eps)
    assert tv_eform(p, c, clip=False).item() == pytest.approx(tv_uniform(eps, clip=False).item(), rel=1e-12, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(logits_st)
def test_zero_radius_gives_zero(logits):
    p = torch.softmax(torch.tensor(logits, dtype=F64), -1)
    for form in FORMS:
        assert 0.0 <= tv_bound(p, torch.zeros_like(p), form).item() <= 1e-15, form


# ---------------------------------------------------------- blockwise refinement (docs/read-path.md#kernel-refinement)
def test_blockwise_accumulation_equals_per_token_sum():
    gen = torch.Generator().manual_seed(3)
    blocks, size = 32, 16
    p = torch.softmax(torch.randn(6, blocks * size, generator=gen, dtype=F64) * 3, -1)
    c_block = torch.rand(6, blocks, generator=gen, dtype=F64) * 2
    c = c_block.repeat_interleave(size, dim=-1)  # constant inside each block
    mass_block = p.unflatten(-1, (blocks, size)).sum(-1)
    per_token, per_block = moments(p, c), moments(mass_block, c_block)
    torch.testing.assert_close(per_block.a, per_token.a, rtol=1e-14, atol=0)
    torch.testing.assert_close(per_block.b, per_token.b, rtol=1e-14, atol=0)
    for form in ("eform", "two_sided", "ptm", "meter"):
        torch.testing.assert_close(tv_bound(mass_block, c_block, form), tv_bound(p, c, form), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- broadcasting, masked tokens, fused meter
def test_broadcasting_and_masked_tokens():
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 3, 10, generator=gen, dtype=F64), -1)
    c = torch.rand(10, generator=gen, dtype=F64)
    for form in FORMS:
        assert tv_bound(p, c, form).shape == (4, 3)
    # a zero-probability token may carry any finite radius without changing any bound
    pm = torch.tensor([0.3, 0.7, 0.0], dtype=F64)
    for form in FORMS:
        a = tv_bound(pm, torch.tensor([0.1, 0.2, 0.0], dtype=F64), form)
        b = tv_bound(pm, torch.tensor([0.1, 0.2, 1e6], dtype=F64), form)
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)


def test_zero_probability_radii_change_no_bit_and_dead_rows_read_zero():
    """Radii of zero-probability tokens are zeroed without a host sync deciding whether any is huge: a bound is
    the same to the bit whatever finite radius such a token carries; a row with no visible token reads 0."""
    gen = torch.Generator().manual_seed(12)
    p = torch.softmax(torch.randn(5, 16, generator=gen, dtype=F64), -1)
    p[:, ::3] = 0.0
    p = p / p.sum(-1, keepdim=True)
    c = torch.rand(5, 16, generator=gen, dtype=F64) * 4
    for big in (0.0, 250.0, 1e6):
        moved = torch.where(p > 0, c, big)
        for form in ("eform", "two_sided", "ptm", "meter"):
            for clip in (True, False):
                assert torch.equal(tv_bound(p, moved, form, clip), tv_bound(p, c, form, clip)), (form, big)
    rows = torch.cat([p, torch.zeros(2, 16, dtype=F64)])
    clipped, raw = served_meter(rows, torch.cat([c, torch.ones(2, 16, dtype=F64)]))
    assert torch.equal(clipped[:5], tv_meter(p, c)) and torch.equal(raw[:5], tv_meter(p, c, clip=False))
    assert torch.equal(clipped[5:], torch.zeros(2, dtype=F64)) and torch.equal(raw[5:], torch.zeros(2, dtype=F64))


@pytest.mark.parametrize(
    ("p", "c", "message"),
    [
        ([0.5, 0.5], [0.1, -0.1], r"radius must be finite and non-negative \(min=-0.1, max=0.1\)"),
        ([math.nan, 0.5], [0.1, 0.1], r"p_served must be finite and non-negative \(min=nan, max=nan\)"),
        ([0.2, 0.2], [0.1, 0.1], r"p_served rows must sum to 1 \(row masses range over \[0.4, 0.4\]\)"),
    ],
)
def test_a_deferred_range_check_raises_the_same_error_at_the_read_back(p, c, message):
    """Inside :func:`kvcert.checks.deferred` the range checks wait for the owner's read-back, which raises the
    error (message and values) the immediate check raises; a guard that says the inputs were out of domain drops
    them."""
    p, c = torch.tensor(p, dtype=F64), torch.tensor(c, dtype=F64)
    with pytest.raises(ValueError, match=message):
        tv_meter(p, c)
    checks = Checks()
    with deferred(checks):
        tv_meter(p, c)  # no error yet
    with pytest.raises(ValueError, match=message):
        checks.read_back()
    with deferred(checks):
        tv_meter(p, c)
    assert checks.read_back(guard=torch.tensor(False)) is None


def test_fused_meter_matches_separate_calls():
    gen = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(3, 3, 512, generator=gen) * 2, -1)
    c = torch.rand(3, 3, 512, generator=gen, dtype=F64) * torch.tensor([0.1, 1.0, 5.0], dtype=F64)[:, None, None]
    clipped, raw = meter_and_unclipped(p, c)
    torch.testing.assert_close(clipped, tv_meter(p, c))
    torch.testing.assert_close(raw, tv_meter(p, c, clip=False))
    assert bool((raw > 1).any()) and bool((raw < 1).any())


# ---------------------------------------------------------------- overflow: trivial bound, never NaN
@pytest.mark.parametrize(
    "p, c",
    [
        ([1.0, 0.0, 0.0], [800.0, 1e6, 1e300]),  # huge radii on masked tokens and on the support
        ([0.5, 0.5, 0.0], [1000.0, 1000.0, 0.0]),  # B₋ underflows to 0, A overflows
        ([1e-300, 1.0 - 1e-300], [700.0, 0.0]),  # tiny mass times huge factor
        ([0.25, 0.75], [400.0, 0.0]),  # A finite, A² overflows
    ],
)
def test_overflow_returns_trivial_bound(p, c):
    p, c = torch.tensor(p, dtype=F64), torch.tensor(c, dtype=F64)
    for form in FORMS:
        clipped, raw = tv_bound(p, c, form), tv_bound(p, c, form, clip=False)
        assert not bool(torch.isnan(clipped)) and not bool(torch.isnan(raw)), form
        assert 0.0 <= clipped.item() <= 1.0
        assert raw.item() >= clipped.item()
    assert tv_meter(p, c).item() in (0.0, 1.0) or p[0] == 1.0
    assert not bool(torch.isnan(tv_tail(torch.tensor([0.0, 1.0]), 1e6, clip=False)).any())
    assert tv_uniform(1e6, clip=False).item() == math.inf


# ---------------------------------------------------------------- bad input fails closed
@pytest.mark.parametrize("form", FORMS)
def test_bad_input_names_the_argument(form):
    p = torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="radius"):
        tv_bound(p, torch.tensor([0.1, -0.1]), form)
    with pytest.raises(ValueError, match="radius"):
        tv_bound(p, torch.tensor([0.1, math.inf]), form)
    with pytest.raises(ValueError, match="radius"):
        tv_bound(p, torch.tensor([0.1, math.nan]), form)
    with pytest.raises(ValueError, match="p_served"):
        tv_bound(torch.tensor([math.nan, 0.5]), torch.tensor([0.1, 0.1]), form)
    with pytest.raises(ValueError, match="p_served"):
        tv_bound(torch.tensor([1.5, -0.5]), torch.tensor([0.1, 0.1]), form)
    with pytest.raises(ValueError, match="p_served"):
        tv_bound(torch.tensor([0.2, 0.2]), torch.tensor([0.1, 0.1]), form)


def test_other_bad_inputs():
    with pytest.raises(ValueError, match="eform, two_sided, ptm, meter, tanh_max, tanh_osc"):
        tv_bound(torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), "dispersion")
    with pytest.raises(ValueError, match="eps"):
        tv_uniform(-0.1)
    with pytest.raises(ValueError, match="alpha_t"):
        tv_tail(1.5, 0.1)
    with pytest.raises(ValueError, match="delta"):
        tv_tail(0.5, math.nan)
    with pytest.raises(ValueError, match="p_served"):
        tv_tanh_osc(torch.ones(2, 0), torch.ones(2, 0))


def test_ptm_equals_direct_per_token_min():
    # the implementation uses min(f₁, f₂) = f₂ − (f₂ − f₁)₊ summed in closed form; compare to the definition
    gen = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(500, 40, generator=gen, dtype=F64) * 3, -1)
    c = torch.rand(500, 40, generator=gen, dtype=F64) * 10.0 ** (torch.rand(500, 1, generator=gen) * 5 - 4)
    c[0, 0] = 400.0  # one row above the overflow-safe range must not change the other rows
    a = (p * c.exp()).sum(-1, keepdim=True)
    b = (p * (-c).exp()).sum(-1, keepdim=True)
    direct = 0.5 * (p * torch.minimum(a * c.exp() - 1, c.exp() / b - (-c).exp() / a)).sum(-1)
    got = tv_bound(p, c, "ptm", clip=False)
    torch.testing.assert_close(got[1:], direct[1:], rtol=1e-10, atol=1e-14)
    assert got[0] >= direct[0] and torch.isfinite(got[0])


def test_shapes_that_do_not_broadcast_are_named():
    """A radius, second distribution or value tensor of another token count used to fail inside torch with an unnamed
    size error; each bound names its arguments and their shapes."""
    from kvcert.bounds import output_error_bound, tv_box

    p = torch.full((2, 5), 0.2, dtype=F64)
    c = torch.ones(2, 4, dtype=F64)
    values = torch.zeros(2, 5, 8)
    cases = [
        (lambda: tv_meter(p, c), r"p_served \(2, 5\), radius \(2, 4\)"),
        (lambda: tv_bound(p, c, "ptm"), r"p_served \(2, 5\), radius \(2, 4\)"),
        (lambda: tv_box(p, c), r"p_served \(2, 5\), radius \(2, 4\)"),
        (lambda: true_tv(p, torch.full((3, 5), 0.2)), r"p \(2, 5\), q \(3, 5\)"),
        (lambda: output_error_bound(p, torch.zeros(2), values[:, :4], torch.zeros(2, 5)), r"v_hat_tokens \(2, 4\)"),
        (lambda: output_error_bound(p, torch.zeros(3), values, torch.zeros(2, 5)), r"p_served_rows \(2,\), tv \(3,\)"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match="shapes do not broadcast: .*" + match):
            call()
    assert tv_meter(p, torch.ones(2, 1, dtype=F64)).shape == (2,)  # a per-row radius still broadcasts


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
@pytest.mark.parametrize("side", ["p", "q"])
def test_true_tv_refuses_what_no_distribution_holds(bad, side):
    """A NaN distance used to come back from NaN input, and a NaN compares as no violation against any bound: the
    argument holding it is named instead."""
    good = torch.full((2, 4), 0.25, dtype=F64)
    broken = good.clone()
    broken[1, 2] = bad
    args = (broken, good) if side == "p" else (good, broken)
    with pytest.raises(ValueError, match=f"^{side} must be finite and non-negative"):
        true_tv(*args)
    assert float(true_tv(good, good).abs().max()) == 0.0
