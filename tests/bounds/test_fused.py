"""The fused softmax + meter kernel refines the eager reference (``certificates.md`` §2.6), cell by cell."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import pytest
import torch
from bounds_adversarial import SLACK, make_cells

from kvcert.attention.certified import served_certificate
from kvcert.bounds import band_norms, pair_components, round_up_f32, true_tv
from kvcert.bounds.fused import read_radii, softmax_meter
from kvcert.bounds.radii import tier_a_radius_f32
from kvcert.bounds.rc import gamma_f32

PLAN = ((2, 20_000), (5, 10_000), (16, 10_000), (64, 4_000), (256, 1_000), (1024, 300), (4096, 60))


def _served(cells_p: torch.Tensor) -> torch.Tensor:
    """float32 served logits whose float64 softmax is (up to float32 rounding) ``cells_p``; zeros -> -inf."""
    return torch.log(cells_p).to(torch.float32)


@pytest.mark.parametrize(("s", "rows"), PLAN)
def test_fused_certificate_bounds_true_tv_in_every_adversarial_cell(s: int, rows: int) -> None:
    cells = make_cells(rows, s, torch.Generator().manual_seed(s))
    logits = _served(cells.p_served)
    p, _, cert, raw, _ = softmax_meter(logits, cells.radius)
    p_exact = torch.softmax(logits.to(torch.float64) - cells.eps, dim=-1)   # exact logits s = s̃ − ε, |ε| ≤ c
    tv = true_tv(p_exact, p)
    bad = cert + SLACK < tv
    assert not bool(bad.any()), f"S={s}: cert={cert[bad][:3].tolist()} tv={tv[bad][:3].tolist()}"
    assert bool((cert <= 1.0).all()) and bool((raw >= cert).all())


@pytest.mark.parametrize(("s", "rows"), PLAN)
def test_fused_agrees_with_the_eager_reference_per_cell(s: int, rows: int) -> None:
    cells = make_cells(rows, s, torch.Generator().manual_seed(100 + s))
    logits = _served(cells.p_served)
    mask = logits > float("-inf")
    p_f, p32_f, cert_f, raw_f, tanh_f = served_certificate(logits, cells.radius, mask, False, fused=True)
    p_e, _, cert_e, raw_e, tanh_e = served_certificate(logits, cells.radius, mask, False, fused=False)
    assert torch.allclose(p_f, p_e, rtol=1e-12, atol=1e-15)
    assert torch.equal(p32_f, p_f.to(torch.float32))
    assert torch.allclose(tanh_f, tanh_e, rtol=1e-12, atol=0)
    # where the reference is informative or near it: never below it by more than float64 rounding, and
    # above it by at most the stated rounding allowance
    near = raw_e <= 10.0
    gap = raw_f[near] - raw_e[near]
    assert bool((gap >= -1e-12).all()), float(gap.min())
    assert bool((gap <= 1e-9).all()), float(gap.max())
    # saturated cells (a vacuous bound either way): the kernel is never below the reference, both clip to 1
    far = ~near
    assert bool((raw_f[far] >= raw_e[far] * (1 - 1e-12)).all())
    assert bool((cert_f[far] == 1.0).all()) and bool((cert_e[far] == 1.0).all())
    assert torch.equal(cert_f, raw_f.clamp(max=1.0))


def test_fully_masked_rows_and_zero_radii_give_zero() -> None:
    logits = torch.randn(4, 32)
    logits[1] = float("-inf")
    c = torch.rand(4, 32, dtype=torch.float64)
    c[2] = 0.0
    p, _, cert, raw, tanh = softmax_meter(logits, c)
    assert torch.equal(p[1], torch.zeros(32, dtype=torch.float64))
    assert cert[1] == 0 and raw[1] == 0 and tanh[1] == 0
    assert cert[2] == 0 and raw[2] == 0          # p̃ = p exactly: no rounding slack is added
    assert torch.allclose(p.sum(-1)[[0, 2, 3]], torch.ones(3, dtype=torch.float64), atol=1e-12)
    assert bool((cert[[0, 3]] > 0).all())


def test_nan_or_negative_radius_fails_closed() -> None:
    logits = torch.randn(3, 16)
    c = torch.full((3, 16), 0.01, dtype=torch.float64)
    c[0, 5] = float("nan")
    c[1, 2] = -1.0
    _, _, cert, raw, _ = softmax_meter(logits, c)
    assert cert[0] == 1 and math.isinf(raw[0])
    assert cert[1] == 1 and math.isinf(raw[1])
    assert cert[2] < 1


@pytest.mark.parametrize("huge", [301.0, 800.0])
def test_huge_radii_give_the_trivial_bound_without_nan(huge: float) -> None:
    logits = torch.randn(2, 64)
    c = torch.full((2, 64), 1e-3, dtype=torch.float64)
    c[0, 7] = huge
    mask = torch.ones(2, 64, dtype=torch.bool)
    _, _, cert_f, raw_f, _ = served_certificate(logits, c, mask, True, fused=True)
    _, _, cert_e, raw_e, _ = served_certificate(logits, c, mask, True, fused=False)
    assert not bool(torch.isnan(raw_f).any())
    assert cert_f[0] == 1 and cert_e[0] == 1 and raw_f[0] >= raw_e[0]
    assert abs(float(raw_f[1] - raw_e[1])) <= 1e-9


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="same shape"):
        softmax_meter(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.float64))


def _exact_radii(q: torch.Tensor, rho: torch.Tensor, khn: torch.Tensor, w: torch.Tensor, sc: float,
                 gam: float, pairing: str) -> list[list[list[list[Decimal]]]]:
    """``c`` of :func:`read_radii` in 50-digit decimal arithmetic from the float32 inputs (the exact value up
    to 10^-45 relative)."""
    getcontext().prec = 50
    b, h, m, d = q.shape
    nb = rho.shape[-1]
    re, im = pair_components(q, pairing)
    per = (d // 2) // nb
    dsc, dgam = Decimal(sc), Decimal(gam)
    out = []
    for bi in range(b):
        heads = []
        for hi in range(h):
            rows = []
            for mi in range(m):
                sq = [Decimal(float(re[bi, hi, mi, j])) ** 2 + Decimal(float(im[bi, hi, mi, j])) ** 2
                      for j in range(d // 2)]
                qb = [sum(sq[k * per:(k + 1) * per], Decimal(0)).sqrt() for k in range(nb)]
                qn = sum(sq, Decimal(0)).sqrt()
                rows.append([dsc * sum((qb[k] * Decimal(float(rho[bi, hi, t, k])) for k in range(nb)), Decimal(0))
                             + dsc * dgam * qn * (2 * Decimal(float(khn[bi, hi, t])) + Decimal(float(w[bi, hi, t])))
                             for t in range(rho.shape[2])])
            heads.append(rows)
        out.append(heads)
    return out


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_read_radii_are_never_below_the_exact_radius_per_cell(pairing: str) -> None:
    gen = torch.Generator().manual_seed(7)
    b, h, m, d, s, nb = 2, 2, 3, 16, 24, 4
    q = torch.randn(b, h, m, d, generator=gen) * torch.logspace(-3, 2, d)
    rho = torch.rand(b, h, s, nb, generator=gen) * 0.1
    rho[0, 0, 3] = 0.0
    khn, w = torch.rand(b, h, s, generator=gen) * 10, torch.rand(b, h, s, generator=gen) * 0.1
    sc, gam = 0.125, gamma_f32(d + 1)
    c, qn, kmax, phi, wmax = read_radii(q, rho, khn, w, sc, gam, pairing)
    exact = _exact_radii(q, rho, khn, w, sc, gam, pairing)
    below = [(bi, hi, mi, t) for bi in range(b) for hi in range(h) for mi in range(m) for t in range(s)
             if Decimal(float(c[bi, hi, mi, t])) < exact[bi][hi][mi][t]]
    assert not below, f"{len(below)} cells below the exact radius, e.g. {below[:3]}"
    rel = max(float((Decimal(float(c[bi, hi, mi, t])) - exact[bi][hi][mi][t]) / exact[bi][hi][mi][t])
              for bi in range(b) for hi in range(h) for mi in range(m) for t in range(s))
    assert rel < 1e-13                                      # the inflation is tiny
    assert torch.allclose(qn[..., 0], q.to(torch.float64).norm(dim=-1), rtol=1e-14)
    kf = 2 * khn.to(torch.float64) + w.to(torch.float64)
    assert torch.equal(kmax[..., 0], kf.amax(-1)) and torch.equal(wmax[..., 0], w.to(torch.float64).amax(-1))
    assert torch.all(phi[..., 0] >= 2 * sc * gam * qn[..., 0].amax(-1) * kf.amax(-1))


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_read_radii_agree_with_the_eager_read_path(pairing: str) -> None:
    gen = torch.Generator().manual_seed(11)
    b, h, m, d, s, nb = 1, 3, 3, 64, 300, 8
    q = torch.randn(b, h, m, d, generator=gen)
    rho = torch.rand(b, h, s, nb, generator=gen) * 0.05
    khn, w = torch.rand(b, h, s, generator=gen) * 5, torch.rand(b, h, s, generator=gen) * 0.05
    c, *_ = read_radii(q, rho, khn, w, 0.125, gamma_f32(d + 1), pairing)
    qb = round_up_f32(band_norms(q, nb, pairing))
    rate = 0.125 * gamma_f32(d + 1) * q.to(torch.float64).norm(dim=-1, keepdim=True)
    eager = tier_a_radius_f32(qb, rho.unsqueeze(2), 0.125).addcmul_(
        rate, (2 * khn.to(torch.float64) + w.to(torch.float64)).unsqueeze(2))
    assert torch.allclose(c, eager, rtol=2e-6, atol=0)     # eager rounds through float32; the kernel does not


def test_read_radii_name_bad_shapes() -> None:
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="read_radii shapes differ"):
        read_radii(q, torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5), 1.0, 1e-6, "rotate_half")
    with pytest.raises(ValueError, match="read_radii shapes differ"):
        read_radii(q, torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 6), torch.zeros(1, 2, 5), 1.0, 1e-6, "rotate_half")
