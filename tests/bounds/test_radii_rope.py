"""Tier-A radii: RoPE invariance of band norms (both pairings), post-RoPE Cauchy–Schwarz radius per cell."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvcert.bounds import band_norms, query_band_norms, round_up_f32, tier_a_radius, tier_a_radius_from_qnorms
from kvcert.bounds.radii import tier_a_radius_f32

F64 = torch.float64
D, HEADS = 64, 4


def hf_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' own rotate_half RoPE (LlamaRotaryEmbedding + apply_rotary_pos_emb), x[1, H, T, D]."""
    cfg = LlamaConfig(hidden_size=D * HEADS, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=D)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions.unsqueeze(0))
    rotated, _ = apply_rotary_pos_emb(x, x, cos.to(x.dtype), sin.to(x.dtype))
    return rotated


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """GPT-J / Meta-reference RoPE: pair (x_{2j}, x_{2j+1}) rotated by pos·θ_j, x[..., T, D]."""
    theta = base ** (-torch.arange(0, D, 2, dtype=F64) / D)
    angle = positions.to(F64)[:, None] * theta[None, :]
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(42)


@pytest.mark.parametrize("bands", [1, 4, 8, 16])
def test_band_norms_invariant_under_hf_rotate_half(gen, bands):
    x = torch.randn(1, HEADS, 6, D, generator=gen, dtype=F64)
    positions = torch.tensor([0, 1, 17, 513, 4095, 32767])
    rotated = hf_rope(x, positions)
    assert not torch.allclose(rotated, x)
    torch.testing.assert_close(band_norms(rotated, bands, "rotate_half"), band_norms(x, bands, "rotate_half"))


@pytest.mark.parametrize("bands", [1, 4, 8, 16])
def test_band_norms_invariant_under_interleaved_rope(gen, bands):
    x = torch.randn(HEADS, 6, D, generator=gen, dtype=F64)
    rotated = interleaved_rope(x, torch.tensor([0, 3, 99, 1000, 8191, 65535]))
    torch.testing.assert_close(band_norms(rotated, bands, "interleaved"), band_norms(x, bands, "interleaved"))


def test_contiguous_real_bands_are_not_invariant_under_rotate_half(gen):
    # contiguous real chunks [8b, 8b+8) are the "interleaved" bands: under HF rotate_half they split pairs
    x = torch.randn(1, HEADS, 4, D, generator=gen, dtype=F64)
    rotated = hf_rope(x, torch.tensor([5, 50, 500, 5000]))
    drift = (band_norms(rotated, 8, "interleaved") - band_norms(x, 8, "interleaved")).abs().amax()
    assert drift > 0.1


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("bands", [1, 8])
def test_cauchy_schwarz_radius_holds_post_rope_per_cell(gen, pairing, bands):
    seq, scale = 300, D**-0.5
    q = torch.randn(HEADS, 1, D, generator=gen, dtype=F64) * 3
    dk = torch.randn(HEADS, seq, D, generator=gen, dtype=F64) * torch.logspace(-4, 0, seq, dtype=F64)[:, None]
    q_pos = torch.randint(0, 40000, (1,), generator=gen)
    k_pos = torch.randint(0, 40000, (seq,), generator=gen)
    if pairing == "rotate_half":
        q_rot = hf_rope(q.unsqueeze(0), q_pos)[0]
        dk_rot = hf_rope(dk.unsqueeze(0), k_pos)[0]
    else:
        q_rot, dk_rot = interleaved_rope(q, q_pos), interleaved_rope(dk, k_pos)
    eps = scale * (q_rot @ dk_rot.transpose(-1, -2)).squeeze(-2)  # [H, S] logit errors after RoPE
    rho = band_norms(dk, bands, pairing)  # witness computed pre-RoPE, at write time
    c = tier_a_radius(q.squeeze(-2), rho, scale, pairing)  # from the pre-RoPE query
    assert c.shape == (HEADS, seq)
    assert bool((eps.abs() <= c).all())
    # a larger number of bands is never looser than global Cauchy–Schwarz
    c_global = scale * q.squeeze(-2).norm(dim=-1, keepdim=True) * dk.norm(dim=-1)
    assert bool((c <= c_global * (1 + 1e-6)).all())


def test_float32_radius_never_below_exact_float64(gen):
    # the fast path runs the matmul in float32 and inflates; check per element against float64 math,
    # over magnitudes from subnormal-level to large, with the GQA layout and a band-major (transposed) store
    bands, seq = 8, 2000
    mags = torch.logspace(-40, 3, seq, dtype=F64)
    kn64 = torch.rand(3, seq, bands, generator=gen, dtype=F64) * mags[:, None]
    kn32 = kn64.to(torch.float32)
    kn_stored = torch.where(kn32.to(F64) < kn64, torch.nextafter(kn32, torch.tensor(float("inf"))), kn32)
    qn = torch.rand(3, 3, bands, generator=gen, dtype=F64) * 10
    exact = torch.einsum("hgb,hsb->hgs", qn, kn_stored.to(F64)) * 0.125
    for kn in (
        kn_stored.unsqueeze(1),
        kn_stored.transpose(-1, -2).contiguous().transpose(-1, -2).unsqueeze(1),
    ):
        fast = tier_a_radius_from_qnorms(qn, kn, 0.125)
        assert fast.dtype == F64 and fast.shape == (3, 3, seq)
        assert bool((fast >= exact).all())
        assert bool((fast <= exact * (1 + 1e-5) + 1e-40).all())
    # the generic broadcast path agrees
    generic = tier_a_radius_from_qnorms(qn[:, 0], kn_stored, 0.125)
    assert bool((generic >= exact[:, 0]).all())
    # the read path's unchecked entry point, fed float32 query norms rounded up, is the same computation
    hot = tier_a_radius_f32(round_up_f32(qn), kn_stored.unsqueeze(1), 0.125)
    assert torch.equal(hot, tier_a_radius_from_qnorms(qn, kn_stored.unsqueeze(1), 0.125))


def test_query_band_norms_and_bad_inputs(gen):
    q = torch.randn(2, D, generator=gen)
    qn = query_band_norms(q, 8)
    torch.testing.assert_close((qn**2).sum(-1), (q.to(F64) ** 2).sum(-1))
    with pytest.raises(ValueError, match="q"):
        query_band_norms(torch.full((D,), float("nan")), 8)
    with pytest.raises(ValueError, match="key_band_norms"):
        tier_a_radius_from_qnorms(qn, -torch.ones(5, 8), 0.1)
    with pytest.raises(ValueError, match="q_band_norms"):
        tier_a_radius_from_qnorms(qn * float("inf"), torch.ones(5, 8), 0.1)
    with pytest.raises(ValueError, match="band"):
        tier_a_radius_from_qnorms(qn, torch.ones(5, 4), 0.1)
    with pytest.raises(ValueError, match="scale"):
        tier_a_radius_from_qnorms(qn, torch.ones(5, 8), 0.0)


def test_norm_up_f32_never_below_the_exact_norm(gen):
    # exact reference: float32 squares are exact in float64, math.fsum sums them with one rounding, and
    # Decimal takes the square root to 40 digits; per vector, over magnitudes from tiny to huge
    import math
    from decimal import Decimal, getcontext

    from kvcert.bounds import norm_up_f32

    getcontext().prec = 40
    x = (torch.randn(400, 64, generator=gen) * torch.logspace(-18, 18, 400).unsqueeze(-1)).to(torch.float32)
    x[0] = 0.0
    x[1] = torch.tensor(1.0)  # a norm that is exactly representable: must not be rounded below
    up = norm_up_f32(x)
    assert up.dtype == torch.float32 and up.shape == (400,)
    for row, bound in zip(x.tolist(), up.tolist(), strict=True):
        exact = Decimal(math.fsum(v * v for v in row)).sqrt()
        assert Decimal(bound) >= exact
        assert Decimal(bound) <= exact * Decimal(1 + 2**-21) + Decimal(2e-45)  # 0 -> smallest subnormal
