"""The log8 witness code: decoded values are never below the encoded ones (per element), 0 stays 0, NaN/inf and
values beyond float32 fail closed to +inf, and the overestimate is below 2^(1/16) at or above the base."""

from __future__ import annotations

import math

import pytest
import torch
from codec_cells import (
    WITNESS_FORMS,
    WITNESS_PLAN,
    adversarial_witnesses,
    make_codec_cells,
    violations,
    witness_element_violations,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.checks import Checks, deferred
from kvcert.quant import logcode

F32_MAX = float(torch.finfo(torch.float32).max)
STEP = 2.0 ** (1 / logcode.SUB) * (1 + 2.0**-22)  # one code (and one float32 ulp of the fraction table)


def _roundtrip(x: torch.Tensor, base: int) -> torch.Tensor:
    b = torch.full(x.shape, base, dtype=torch.int32)
    return logcode.decode(logcode.encode(x, b), b)


def test_fraction_table_is_rounded_up_and_increasing():
    f = logcode.FRACTIONS.to(torch.float64)
    exact = torch.tensor([2.0 ** (k / logcode.SUB) for k in range(logcode.SUB)], dtype=torch.float64)
    assert (f >= exact).all() and (f - exact < 2.0**-22).all()
    n = torch.arange(logcode.MIN_N, logcode.MAX_N + 1, dtype=torch.int32)
    d = logcode.dec(n).to(torch.float64)
    assert torch.isfinite(d).all() and (d.diff() > 0).all()  # strictly increasing, never overflows
    assert (d >= torch.exp2(n.to(torch.float64) / logcode.SUB) * (1 - 1e-15)).all()


@settings(max_examples=400, deadline=None)
@given(
    x=st.floats(min_value=0.0, max_value=F32_MAX, allow_nan=False, width=32),
    base=st.integers(min_value=logcode.MIN_N, max_value=logcode.MAX_N),
)
def test_decode_never_below_the_value(x, base):
    t = torch.tensor([x], dtype=torch.float32)
    n = int(logcode.exponent_up(t)[0])
    if x > 0 and n <= logcode.MAX_N:
        base = min(max(base, n - (logcode.TOP - 1)), n + 300)  # a base the buffer could hold for x
    y = float(_roundtrip(t, base)[0])
    assert y >= x
    if x == 0:
        assert y == 0.0
    elif n <= logcode.MAX_N and x >= float(logcode.dec(torch.tensor(base))):
        assert y <= x * STEP  # at most one code above


@settings(max_examples=200, deadline=None)
@given(x=st.floats(min_value=0.0, max_value=1e30, allow_nan=False, width=64))
def test_float64_input_is_not_rounded_down(x):
    t = torch.tensor([x], dtype=torch.float64)
    n = logcode.exponent_up(t)
    base = torch.where(n > logcode.MIN_N, n - 5, n)
    assert float(logcode.decode(logcode.encode(t, base), base)[0]) >= x


@pytest.mark.parametrize(
    "x,expected",
    [(0.0, 0.0), (float("inf"), math.inf), (3.4028235e38, math.inf), (1.0, 1.0), (2.0, 2.0)],
)
def test_adversarial_values(x, expected):
    assert float(_roundtrip(torch.tensor([x]), 0)[0]) == expected


def test_nan_and_denormals_fail_closed_or_round_up():
    assert math.isinf(float(_roundtrip(torch.tensor([float("nan")]), 0)[0]))
    tiny = torch.tensor([1e-45, 1e-40, 1.1754942e-38])  # denormals decode to the smallest base 2^-126
    y = _roundtrip(tiny, logcode.MIN_N)
    assert (y >= tiny).all() and (y == 2.0**-126).all()


def test_values_below_the_base_decode_to_the_base():
    y = _roundtrip(torch.tensor([1e-3, 0.5, 0.99]), 0)
    assert (y == 1.0).all()


def test_negative_and_overflowing_codes_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        logcode.encode(torch.tensor([-1.0]), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="rebase"):
        logcode.encode(torch.tensor([2.0**20]), torch.tensor([0], dtype=torch.int32))


def test_the_encoders_check_waits_for_the_deferred_read_back_and_names_the_negative_entry_first():
    """Inside :func:`kvcert.checks.deferred` the encoder's check raises nothing until the owner reads it back, then
    the error the immediate check raises; a negative entry is named before a value above the top code."""
    base = torch.tensor([0, 0], dtype=torch.int32)
    both = torch.tensor([-1.0, 2.0**20])
    for x, message in ((torch.tensor([2.0**20, 1.0]), "rebase"), (both, "non-negative, got min -1.0")):
        with pytest.raises(ValueError, match=message):
            logcode.encode(x, base)
        checks = Checks()
        with deferred(checks):
            logcode.encode_checked(x, base, logcode.exponent_up(x))
        with pytest.raises(ValueError, match=message):
            checks.read_back()


def test_rebase_only_raises_decoded_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1000, generator=gen) * 100
    base = torch.zeros(1000, dtype=torch.int32)
    code = logcode.encode(x, base)
    before = logcode.decode(code, base)
    for shift in (1, 7, 40, 300):
        s = torch.full((1000,), shift, dtype=torch.int32)
        after = logcode.decode(logcode.rebase(code, s), base + s)
        assert (after >= before).all() and (after >= x).all()
    zero = torch.zeros(3, dtype=torch.uint8)
    assert (logcode.rebase(zero, torch.full((3,), 5)) == 0).all()


def test_element_fuzz_ci():
    """2·10^5 adversarial elements (random bit patterns, code edges ± 1 ulp, specials): zero violations."""
    gen = torch.Generator().manual_seed(1)
    bad, worst = 0, 0.0
    for _ in range(4):
        b, w = witness_element_violations(adversarial_witnesses(50_000, gen), gen)
        bad, worst = bad + b, max(worst, w)
    assert bad == 0
    assert 1.0 <= worst <= STEP


@pytest.mark.parametrize("codec,witness", WITNESS_FORMS)
def test_log8_witness_cells_ci(codec, witness):
    """End-to-end: keys → codec → band norms → log8 → Tier-A radius → meter, 2·10^5 cells per form (bases drawn
    adversarially); |ε_t| ≤ c_t per token and meter ≥ TV per cell."""
    gen = torch.Generator().manual_seed(2)
    cells = 0
    for _ in range(2):  # WITNESS_PLAN: 10^5 cells a round
        for s, rows in WITNESS_PLAN:
            r, m = violations(make_codec_cells(codec, rows, s, gen, witness=witness))
            assert (r, m) == (0, 0), (s, r, m)
            cells += rows
    assert cells >= 200_000


@settings(max_examples=300, deadline=None)
@given(
    xs=st.lists(
        st.one_of(
            st.floats(min_value=0.0, max_value=F32_MAX, allow_nan=False, width=32),
            st.sampled_from([0.0, float("inf"), float("nan"), -1.0, 2.0**-126, 2.0**-149, F32_MAX]),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_exponent_settle_agrees_with_the_exact_search_when_settled(xs):
    """``exponent_settle`` (no wait for the device) returns ``exponent_up``'s exponents whenever it reports them
    settled, and ``dec`` at its exponents is at least the value (the property the codes rely on)."""
    x = torch.tensor(xs, dtype=torch.float32)
    n, unsettled = logcode.exponent_settle(x)
    exact = logcode.exponent_up(x)
    if not bool(unsettled):
        assert torch.equal(n, exact)
    ok = torch.isfinite(x) & (x > 0) & (exact <= logcode.MAX_N)
    assert (logcode.dec(exact.clamp(max=logcode.MAX_N))[ok].to(torch.float64) >= x[ok].to(torch.float64)).all()


def test_exponent_settle_flags_a_guess_it_did_not_correct(monkeypatch):
    """With no correction round the check round still sees the entries the float64 guess got wrong: the flag is
    raised, and ``exponent_up`` (which keeps stepping) gives the smallest exponent with ``dec(n) ≥ x``."""
    monkeypatch.setattr(logcode, "SETTLE_ROUNDS", 0)
    n0 = torch.arange(-300, 300, dtype=torch.int32)
    x = logcode.dec(n0).to(torch.float64)  # a code's own value: F is rounded up, so 16·log2(x) sits just above n0
    _, unsettled = logcode.exponent_settle(x)
    guess = torch.ceil(logcode.SUB * torch.log2(x)).to(torch.int32)
    assert not torch.equal(guess, n0) and bool(unsettled)  # the guess is one code too high somewhere: flagged
    assert torch.equal(logcode.exponent_up(x), n0)
