"""Latent (MLA) radii against brute-force logit errors, per cell."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds import band_norms, tier_b_radius
from kvcert.bounds.latent import (
    effective_query,
    latent_band_norms,
    latent_tier_a_radius,
    latent_tier_b_sigma2,
)

H, T, S, DN, DPE, R = 3, 4, 11, 8, 6, 16


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].to(torch.float64) * theta
    re, im = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = re * ang.cos() - im * ang.sin()
    out[..., 1::2] = re * ang.sin() + im * ang.cos()
    return out


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(H, DN, R, generator=g, dtype=torch.float64)
    q_nope = torch.randn(H, T, DN, generator=g, dtype=torch.float64)
    q_pe = torch.randn(H, T, DPE, generator=g, dtype=torch.float64)
    c = torch.randn(S, R, generator=g, dtype=torch.float64)
    k_pe = torch.randn(S, DPE, generator=g, dtype=torch.float64)
    return g, w_uk, q_nope, q_pe, c, k_pe


def _logits(w_uk, q_nope, q_pe, c, k_pe, pos_q, pos_k, sm):
    k_nope = torch.einsum("hdr,sr->hsd", w_uk, c)
    kr = _rope_interleaved(k_pe, pos_k)
    qr = _rope_interleaved(q_pe, pos_q)
    return sm * (torch.einsum("htd,hsd->hts", q_nope, k_nope) + torch.einsum("htd,sd->hts", qr, kr))


def test_effective_query_identity():
    _, w_uk, q_nope, _, c, _ = _setup(0)
    u = effective_query(q_nope, w_uk)
    lhs = torch.einsum("htd,hdr,sr->hts", q_nope, w_uk, c)
    assert torch.allclose(torch.einsum("htr,sr->hts", u, c), lhs, atol=1e-10)


@pytest.mark.parametrize("bands,pe_bands", [(1, 1), (4, 3), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tier_a_radius_dominates_every_cell(bands, pe_bands, seed):
    g, w_uk, q_nope, q_pe, c, k_pe = _setup(seed)
    sm = 0.37
    dc = 0.05 * torch.randn(S, R, generator=g, dtype=torch.float64)
    dpe = 0.05 * torch.randn(S, DPE, generator=g, dtype=torch.float64)
    pos_q, pos_k = torch.arange(100, 100 + T), torch.arange(S)
    err = _logits(w_uk, q_nope, q_pe, c + dc, k_pe + dpe, pos_q, pos_k, sm) - _logits(
        w_uk, q_nope, q_pe, c, k_pe, pos_q, pos_k, sm
    )
    u = effective_query(q_nope, w_uk)
    pe_norms = band_norms(dpe, pe_bands, "interleaved")
    rad = latent_tier_a_radius(u, latent_band_norms(dc, bands), sm, q_pe, pe_norms, "interleaved")
    assert rad.shape == (H, T, S)
    assert (err.abs() <= rad).all()
    # the latent part alone does not cover a perturbed rope key: the pe term is needed
    rad_latent_only = latent_tier_a_radius(u, latent_band_norms(dc, bands), sm)
    assert (rad_latent_only < rad).all()


def test_radius_is_tight_for_aligned_residual():
    _, w_uk, q_nope, _, _, _ = _setup(3)
    u = effective_query(q_nope, w_uk)[0, 0]
    dc = 1e-3 * u / u.norm()  # aligned with u: Cauchy-Schwarz is equality with one band
    rad = latent_tier_a_radius(u[None], latent_band_norms(dc[None], 1), 1.0)
    assert math.isclose(float(rad[0, 0]), float(u @ dc), rel_tol=1e-6)


def test_more_bands_never_looser():
    g, w_uk, q_nope, _, _, _ = _setup(4)
    u = effective_query(q_nope, w_uk)
    dc = torch.randn(S, R, generator=g, dtype=torch.float64)
    r1 = latent_tier_a_radius(u, latent_band_norms(dc, 1), 0.5)
    r8 = latent_tier_a_radius(u, latent_band_norms(dc, 8), 0.5)
    assert (r8 <= r1 * (1 + 1e-12)).all()


def _dither(x: torch.Tensor, step: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(x.shape, generator=g, dtype=torch.float64) - 0.5
    return step * (torch.round(x / step + u) - u)


def test_tier_b_radius_holds_for_dithered_latents():
    g, w_uk, q_nope, q_pe, c, _ = _setup(5)
    gs = 4
    step = c.abs().unflatten(-1, (R // gs, gs)).amax(-1) / 126.5  # [S, R/gs]
    u = effective_query(q_nope, w_uk)
    sm, delta = 0.3, 1e-2
    s2 = latent_tier_b_sigma2(u, step, sm, gs)
    assert s2.shape == (H, T, S)
    ub = tier_b_radius(s2, S, delta)
    step_full = step.repeat_interleave(gs, -1)
    fails = 0
    trials = 200
    for _ in range(trials):
        dc = _dither(c, step_full, g) - c
        eps = sm * torch.einsum("htr,sr->hts", u, dc)
        fails += int((eps.abs() > ub).any(-1).sum())
    # each of the H*T cells fails with probability <= delta per trial
    assert fails <= 3 * delta * trials * H * T + 3
    # Tier B is much tighter than Tier A for the same dither steps (worst residual s/2 per coordinate)
    ra = latent_tier_a_radius(u, latent_band_norms(step_full / 2, 8), sm)
    assert (ub < ra).float().mean() > 0.9


def test_tier_b_pe_part_adds_variance():
    _, w_uk, q_nope, q_pe, c, k_pe = _setup(6)
    u = effective_query(q_nope, w_uk)
    step = torch.full((S, 4), 0.01, dtype=torch.float64)
    pe_step = torch.full((S, 2), 0.02, dtype=torch.float64)
    base = latent_tier_b_sigma2(u, step, 0.5, R // 4)
    both = latent_tier_b_sigma2(u, step, 0.5, R // 4, q_pe, pe_step, DPE // 2)
    extra = 0.25 * (q_pe.square().sum(-1, keepdim=True)) * 0.02**2 / 12
    assert torch.allclose(both - base, extra.expand_as(base), rtol=1e-12)


def test_bad_inputs_raise():
    _, w_uk, q_nope, q_pe, _, _ = _setup(7)
    with pytest.raises(ValueError, match="w_uk"):
        effective_query(q_nope, w_uk[0])
    with pytest.raises(ValueError, match="q_nope"):
        effective_query(q_nope[..., :3], w_uk)
    u = effective_query(q_nope, w_uk)
    with pytest.raises(ValueError, match="q_pe and pe_norms"):
        latent_tier_a_radius(u, torch.ones(S, 4, dtype=torch.float64), 1.0, q_pe=q_pe)
    with pytest.raises(ValueError, match="scale"):
        latent_tier_a_radius(u, torch.ones(S, 4, dtype=torch.float64), -1.0)
