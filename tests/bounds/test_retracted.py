"""Must-fail regressions: the retracted forms of ``docs/math.md#retracted-forms`` are NOT bounds (implemented here
only).

Each test shows a concrete violation, and that the shipped form holds on the same case.
"""

from __future__ import annotations

import math

import torch
from bounds_stats import binomial_sf

from kvcert.bounds import FORMS, tier_b_radius, tier_b_sigma2, true_tv, tv_meter

F64 = torch.float64


def retracted_dispersion(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Bound-dispersion ``½ e^{2c_max}(E_p̃|c − c̄| + c̄(e^{c_max} − 1))`` — NOT a bound (Lean ``flawedBound``)."""
    c_bar = (p * c).sum(-1, keepdim=True)
    c_max = c.amax(-1)
    disp = (p * (c - c_bar).abs()).sum(-1)
    return 0.5 * torch.exp(2 * c_max) * (disp + c_bar.squeeze(-1) * torch.expm1(c_max))


def averaged_variance_cert(p: torch.Tensor, sigma2: torch.Tensor, n_tokens: int, delta: float) -> torch.Tensor:
    """M3 shortcut ``½(e^{2u(V̄)} − 1)`` with ``V̄ = Σ p̃_t σ²_t`` — NOT a bound."""
    u_bar = tier_b_radius((p * sigma2).sum(-1), n_tokens, delta)
    return 0.5 * torch.expm1(2 * u_bar)


def test_dispersion_form_fails_on_two_token_instance_by_7_8x():
    p = torch.tensor([0.5, 0.5], dtype=F64)
    c = torch.tensor([0.1, 0.1], dtype=F64)
    eps = torch.tensor([0.1, -0.1], dtype=F64)  # |eps| <= c: the premise holds
    tv = true_tv(torch.softmax(torch.log(p) - eps, -1), p)
    flawed = retracted_dispersion(p, c)
    assert abs(flawed.item() - 0.006423) < 1e-6
    assert flawed < tv  # violated
    assert round((tv / flawed).item(), 1) == 7.8
    assert tv_meter(p, c) >= tv  # the shipped certificate holds on the same cell
    assert "dispersion" not in FORMS


def test_averaged_variance_fails_on_a_concrete_cell():
    # p̃ puts mass 1e-4 on a token with a large Tier-B radius (u = 10) and the rest on an exact token.
    delta, n = 1e-2, 2
    p = torch.tensor([1 - 1e-4, 1e-4], dtype=F64)
    scale = 2 * math.log(2 * n / delta)
    sigma2 = torch.tensor([0.0, 100.0 / scale], dtype=F64)  # u_t = (0, 10)
    u = tier_b_radius(sigma2, n, delta)
    assert torch.allclose(u, torch.tensor([0.0, 10.0], dtype=F64))
    eps = -u  # inside the Tier-B event |eps_t| <= u_t
    tv = true_tv(torch.softmax(torch.log(p) - eps, -1), p)
    shortcut = averaged_variance_cert(p, sigma2, n, delta)
    assert shortcut < tv and (tv / shortcut) > 5  # 0.69 vs 0.11: violated
    assert tv_meter(p, u) >= tv  # the per-token certificate holds


def test_averaged_variance_fails_more_often_than_delta_under_real_dither():
    # Monte Carlo with actual uniform residuals: the shortcut's failure rate is far above δ.
    gen = torch.Generator().manual_seed(11)
    delta, trials, d = 1e-3, 4000, 64
    p = torch.tensor([1 - 1e-3, 1e-3], dtype=F64)
    q = torch.randn(d, generator=gen, dtype=F64)
    steps = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=F64) * (3.0 / (q.norm() / math.sqrt(12)))  # σ₂ = 3
    sigma2 = tier_b_sigma2(q, steps, 1.0)
    s_full = steps.repeat_interleave(32, dim=-1)  # per-channel steps [2, 64]
    r = (torch.rand(trials, 2, d, generator=gen, dtype=F64) - 0.5) * s_full
    eps = (r * q).sum(-1)  # [trials, 2]
    tv = true_tv(torch.softmax(torch.log(p) - eps, -1), p)
    shortcut = averaged_variance_cert(p, sigma2, 2, delta)
    failures = int((tv > shortcut).sum())
    assert binomial_sf(failures, trials, delta) < 1e-6  # the shortcut is not a 1−δ certificate
    # the per-token certificate with the same radii fails only on the δ-event (here never)
    cert = tv_meter(p.expand(trials, 2), tier_b_radius(sigma2, 2, delta).expand(trials, 2))
    assert int((tv > cert + 1e-12).sum()) <= 2
