"""MLA latent extraction: W_UK·c reproduces the model's keys; latent radii dominate live logit errors."""

from __future__ import annotations

import pytest
import torch

import kvcert.integrations.mla as mla
from kvcert.bounds.latent import effective_query, latent_band_norms, latent_tier_a_radius
from kvcert.bounds.rope import band_norms
from kvcert.integrations.mla import MLASelfCheckError, extract_latents, tiny_deepseek_v3

IDS = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=[None, 16], ids=["kv-lora", "q-lora"])
def model(request):
    return tiny_deepseek_v3(seed=3, q_lora_rank=request.param)


def test_self_check_reproduces_model_keys(model):
    layers = extract_latents(model, IDS)
    assert [lat.layer for lat in layers] == [0, 1]
    for lat in layers:
        assert lat.key_residual < 1e-5 and lat.pe_residual < 1e-6
        assert lat.latent.shape == (1, 1, 12, 32) and lat.k_pe.shape == (1, 1, 12, 8)
        assert lat.w_uk.shape == (4, 16, 32) and lat.pairing == "rotate_half"
        # independent reconstruction through the model's own kv_b_proj
        attn = model.model.layers[lat.layer].self_attn
        k_nope = attn.kv_b_proj(lat.latent[:, 0]).view(1, 12, 4, 32)[..., :16].transpose(1, 2)
        assert torch.allclose(k_nope, torch.einsum("hdr,bxsr->bhsd", lat.w_uk, lat.latent), atol=1e-5)


def test_effective_query_reproduces_model_logits(model):
    for lat in extract_latents(model, IDS):
        u = effective_query(lat.q_nope, lat.w_uk)
        ours = lat.scaling * (
            u @ lat.latent.double().transpose(-1, -2) + lat.q_pe.double() @ lat.k_pe.double().transpose(-1, -2)
        )
        k_nope = torch.einsum("hdr,bxsr->bhsd", lat.w_uk, lat.latent)
        key = torch.cat([k_nope, lat.k_pe.expand(-1, 4, -1, -1)], -1)
        q = torch.cat([lat.q_nope, lat.q_pe], -1)
        model_logits = lat.scaling * (q.double() @ key.double().transpose(-1, -2))
        assert torch.allclose(ours, model_logits, atol=1e-5)


def test_latent_radius_dominates_quantized_latent_errors(model):
    g = torch.Generator().manual_seed(0)
    for lat in extract_latents(model, IDS):
        dc = 0.02 * torch.randn(lat.latent.shape, generator=g, dtype=torch.float64)
        dpe = 0.02 * torch.randn(lat.k_pe.shape, generator=g, dtype=torch.float64)
        u = effective_query(lat.q_nope, lat.w_uk)
        err = lat.scaling * (u @ dc.transpose(-1, -2) + lat.q_pe.double() @ dpe.transpose(-1, -2))
        rad = latent_tier_a_radius(
            u, latent_band_norms(dc, 4), lat.scaling, lat.q_pe, band_norms(dpe, 2, lat.pairing), lat.pairing
        )
        assert (err.abs() <= rad).all()
        assert (err.abs() > 0.05 * rad).any()  # not vacuous


def test_wrong_pairing_is_rejected(model):
    with pytest.raises(MLASelfCheckError, match="pairing"):
        extract_latents(model, IDS, pairing="interleaved")


def test_tampered_up_projection_fails_self_check(model, monkeypatch):
    real = mla.up_projection
    monkeypatch.setattr(mla, "up_projection", lambda attn: real(attn) * 1.1)
    with pytest.raises(MLASelfCheckError, match="W_UK"):
        extract_latents(model, IDS)


def test_non_mla_model_rejected():
    from kvcert.models.tiny import tiny_random

    with pytest.raises(ValueError, match="no MLA"):
        extract_latents(tiny_random("llama", attn_implementation="sdpa"), IDS)
