"""The fused Tier-B meter against its eager reference and exact arithmetic, cell by cell.

Per token the kernel's radius is never below the eager float64 radius nor below the exact real value of the
formula (50-digit decimal arithmetic), and at most ``2·10⁻¹²`` relative above the eager one; per cell the meter is
never below the eager meter and at most ``10⁻⁹`` above it, on random, masked, long, tiny / huge step and zero-query
inputs. Non-finite inputs return ``None`` (the read path then takes the eager forms, which raise)."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest
import torch

from kvcert.attention.certified import _logit_slack_factors
from kvcert.bounds import tier_b_radius, tier_b_sigma2
from kvcert.bounds.rc import gamma_f32
from kvcert.bounds.softmax_tv import probs64, served_meter
from kvcert.kernels.numba_read import meter_rows
from kvcert.kernels.numba_tier_b import _tier_b_radii, tier_b_inflation, tier_b_meter

B, H, M, D, GS = 2, 3, 4, 64, 32
SCALE = D**-0.5


def _inputs(seed: int, s: int, *, step_scale: float = 0.02, qscale: float = 1.0, spare: int = 5, masked: bool = True):
    """Grouped queries, store allocations with ``spare`` garbage tokens past ``s``, ``‖q‖`` and a served ``p̃``
    (some tokens masked, one row fully masked)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, M, D, generator=g) * qscale).to(torch.float32)
    cap = s + spare
    steps = (torch.rand(B, H, cap, D // GS, generator=g) * step_scale).to(torch.float32)
    khn = (torch.rand(B, H, cap, generator=g) * 10).to(torch.float32)
    kwit = (torch.rand(B, H, cap, generator=g) * 0.1).to(torch.float32)
    steps[:, :, s:], khn[:, :, s:], kwit[:, :, s:] = 1e30, 1e30, 1e30  # never read
    logits = torch.randn(B, H, M, s, generator=g, dtype=torch.float32) * 4
    if masked:
        logits[:, :, :, ::3] = float("-inf")
        logits[1, 2, 3] = float("-inf")  # a fully masked row
    p = probs64(logits)
    qn = q.to(torch.float64).norm(dim=-1)
    return q.numpy(), steps.numpy(), khn.numpy(), kwit.numpy(), qn.numpy(), p.numpy()


def _eager(q, steps, khn, kwit, qn, p, s, delta):
    """The read path's eager Tier-B forms: ``(radii, meter)``."""
    t = torch.from_numpy
    sig2 = tier_b_sigma2(t(q), t(steps[:, :, :s]).unsqueeze(2), SCALE, GS)
    rate, kfac = _logit_slack_factors(t(qn)[..., None], t(khn[:, :, :s]), t(kwit[:, :, :s]), SCALE, D)
    u = tier_b_radius(sig2, s, delta) + rate * kfac
    return u, served_meter(t(p), u)[0]


def _fused_radii(q, steps, khn, kwit, qn, s, delta):
    u = np.empty((B, H, M, s))
    ok = _tier_b_radii(
        q,
        steps,
        khn,
        kwit,
        qn,
        s,
        GS,
        SCALE * SCALE / 12.0,
        math.log(2.0 * s / delta),
        SCALE * gamma_f32(D + 1),
        tier_b_inflation(GS, D // GS),
        u,
    )
    assert ok
    return torch.from_numpy(u)


CASES = [
    dict(s=97),
    dict(s=4099),
    dict(s=64, step_scale=1e-30),
    dict(s=64, step_scale=3.0, qscale=30.0),
    dict(s=64, qscale=0.0),
    dict(s=1, masked=False),
    dict(s=200, masked=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("delta", [1e-6, 1.0])
def test_fused_tier_b_is_never_below_the_eager_forms(case, delta):
    for seed in range(2):
        kw = dict(case)
        s = kw.pop("s")
        q, steps, khn, kwit, qn, p = _inputs(seed, s, **kw)
        u_ref, ref = _eager(q, steps, khn, kwit, qn, p, s, delta)
        u = _fused_radii(q, steps, khn, kwit, qn, s, delta)
        assert torch.all(u >= u_ref), (u_ref - u).max()
        assert torch.all(u <= u_ref * (1 + 2e-12)), (u / u_ref).max()
        got = tier_b_meter(
            q, steps, khn, kwit, qn, p, s, scale=SCALE, gamma=gamma_f32(D + 1), group_size=GS, delta_loc=delta
        )
        assert got is not None and got.shape == ref.shape and got.dtype == torch.float64
        assert torch.all(got >= ref), (ref - got).max()  # never below, cell by cell
        assert torch.all(got <= ref + 1e-9), (got - ref).max()
        assert torch.all(got <= 1) and torch.all(got >= 0)
        if kw.get("masked", True):
            assert torch.all(got[1, 2, 3] == 0)  # the fully masked row
        if kw.get("qscale") == 0.0:
            assert torch.all(got == 0)  # zero queries: every radius 0, p̃ = p


@pytest.mark.parametrize("s", [1, 37, 2048])
def test_meter_rows_leaves_p_unchanged_and_is_never_below_the_eager_meter_per_row(s):
    """The row kernel reads visibility from the caller's ``p`` and writes a copy (so its loop vectorises, summing in
    another order): per row the meter is never below the eager float64 meter at the same ``p̃`` and radii, at most
    ``10⁻⁹`` above it, and ``p`` is unchanged bit for bit (masked zeros, a fully masked row, tiny and large radii)."""
    g = torch.Generator().manual_seed(7)
    for c_scale in (1e-6, 0.05, 3.0):
        logits = torch.randn(6, s, generator=g, dtype=torch.float64) * 4
        if s > 1:
            logits[:, ::3] = float("-inf")
        logits[5] = float("-inf")  # a row with no visible token
        p = np.ascontiguousarray(probs64(logits).numpy())
        before = p.copy()
        c = (torch.rand(6, s, generator=g, dtype=torch.float64) * c_scale).numpy()
        got = torch.from_numpy(meter_rows(p, c))
        ref = served_meter(torch.from_numpy(before), torch.from_numpy(c))[0]
        assert np.array_equal(p.view(np.uint64), before.view(np.uint64))
        assert torch.all(got >= ref), (ref - got).max()
        assert torch.all(got <= ref + 1e-9), (got - ref).max()
        assert got[5] == 0.0


def test_fused_radii_are_never_below_their_exact_value():
    """The radius formula in 50-digit decimal arithmetic on the kernel's float inputs (the float64 ``‖q‖`` an
    input, ``γ_{D+1}`` and ``ln`` exact): the kernel's value is at least it."""
    getcontext().prec = 50
    s, delta = 9, 1e-6
    q, steps, khn, kwit, qn, _ = _inputs(7, s, masked=False)
    u = _fused_radii(q, steps, khn, kwit, qn, s, delta)
    n24 = Fraction(D + 1, 2**24)
    gam = n24 / (1 - n24)
    sc = Fraction(SCALE)
    log_term = (Decimal(2 * s) / Decimal(delta)).ln()
    for bi in range(B):
        for h in range(H):
            for r in range(M):
                qg2 = [sum(Fraction(float(x)) ** 2 for x in q[bi, h, r, g * GS : (g + 1) * GS]) for g in range(D // GS)]
                rate = sc * gam * Fraction(float(qn[bi, h, r]))
                for t in range(s):
                    sig2 = sc * sc / 12 * sum(Fraction(float(steps[bi, h, t, g])) ** 2 * qg2[g] for g in range(D // GS))
                    kf = 2 * Fraction(float(khn[bi, h, t])) + Fraction(float(kwit[bi, h, t]))
                    sq = (2 * Decimal(sig2.numerator) / Decimal(sig2.denominator) * log_term).sqrt()
                    exact = sq + Decimal((rate * kf).numerator) / Decimal((rate * kf).denominator)
                    assert Decimal(float(u[bi, h, r, t])) >= exact


@pytest.mark.parametrize("where", ["query", "step", "negative step", "witness"])
def test_non_finite_or_negative_inputs_give_none(where):
    q, steps, khn, kwit, qn, p = _inputs(3, 40)
    if where == "query":
        q[0, 1, 2, 5] = math.nan
        qn[0, 1, 2] = math.nan
    elif where == "step":
        steps[1, 0, 7, 1] = math.inf
    elif where == "negative step":
        steps[1, 0, 7, 1] = -0.5
    else:
        khn[0, 2, 3] = -1e6  # a negative radius
    kw = dict(scale=SCALE, gamma=gamma_f32(D + 1), group_size=GS, delta_loc=1e-6)
    assert tier_b_meter(q, steps, khn, kwit, qn, p, 40, **kw) is None


def test_bad_shapes_and_budgets_raise():
    q, steps, khn, kwit, qn, p = _inputs(4, 16)
    kw = dict(scale=SCALE, gamma=gamma_f32(D + 1), group_size=GS)
    with pytest.raises(ValueError, match="delta_loc"):
        tier_b_meter(q, steps, khn, kwit, qn, p, 16, delta_loc=0.0, **kw)
    with pytest.raises(ValueError, match="must be"):
        tier_b_meter(q, steps, khn, kwit, qn, p, 15, delta_loc=1e-6, **kw)
