import math

import pytest
import torch
from codec_cells import CODEC_FORMS, CODEC_PLAN, make_codec_cells, violations
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_cases import fp16_exact, with_outlier_channels

from kvcert.bounds import band_norms, tier_a_radius
from kvcert.quant import bytes_per_token_head, get, quantize
from kvcert.quant.hadamard import hadamard_block, hadamard_matrix, random_signs, rotate, unrotate


def _dense(d: int, seed: int) -> torch.Tensor:
    """The rotation as a dense matrix: column j is R e_j."""
    return rotate(torch.eye(d, dtype=torch.float64), random_signs(d, seed)).T


@pytest.mark.parametrize("d", [2, 16, 64, 96, 128])
def test_rotation_is_orthogonal_and_unrotate_inverts_it(d):
    r = _dense(d, seed=d)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, d, dtype=torch.float64)
    signs = random_signs(d, seed=d)
    assert torch.allclose(unrotate(rotate(x, signs), signs), x, atol=1e-12)
    n = hadamard_block(d)
    assert n == (d & -d)
    assert torch.equal(rotate(x, signs).abs().amax(), rotate(x, signs).abs().amax())  # deterministic


@pytest.mark.parametrize("n", [1, 2, 4, 32])
def test_hadamard_matrix_is_sylvester_with_orthogonal_rows(n):
    h = hadamard_matrix(n)
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert set(h.unique().tolist()) <= {-1.0, 1.0} and torch.equal(h, h.T)
    if n > 1:
        half = hadamard_matrix(n // 2)
        assert torch.equal(h, torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(6)


def test_odd_head_dimension_rejected():
    with pytest.raises(ValueError, match="odd"):
        get("hadamard-int4").encode(torch.randn(1, 1, 2, 7))


def test_signs_are_a_function_of_seed():
    assert torch.equal(random_signs(64, 3), random_signs(64, 3))
    assert not torch.equal(random_signs(64, 3), random_signs(64, 4))
    x = fp16_exact(1, 1, 4, 64)
    assert not torch.equal(
        get("hadamard-int4", seed=1).encode(x).tensors["codes"], get("hadamard-int4", seed=2).encode(x).tensors["codes"]
    )


@pytest.mark.parametrize("bits", [4, 2])
def test_residual_bounded_by_half_step_in_rotated_basis(bits):
    codec = get(f"hadamard-int{bits}")
    x = with_outlier_channels(seed=bits)
    packed = codec.encode(x)
    s = packed.tensors["scales"].to(torch.float64)  # [B, H, T, 1]: one scale per token
    assert packed.tensors["scales"].shape == (*x.shape[:3], 1)
    signs = random_signs(64, 0)
    err = (rotate(codec.decode(packed).double(), signs) - rotate(x.double(), signs)).abs()
    slack = 1e-5 * x.abs().amax()  # float32 rotation and inverse rotation
    assert bool((err <= s / 2 + slack).all())


def test_bytes_measured_from_tensors():
    x = fp16_exact(2, 3, 5, 64)
    packed = get("hadamard-int4").encode(x)
    assert packed.nbytes == 2 * 3 * 5 * (32 + 2)
    assert packed.tensors["codes"].dtype == torch.uint8
    assert bytes_per_token_head(get("hadamard-int4", group_size=32)) == 36
    assert bytes_per_token_head(get("hadamard-int4"), D=128) == 66


def test_rotation_shrinks_the_residual_of_outlier_keys():
    x = with_outlier_channels(seed=5)
    plain = (get("int4").decode(get("int4").encode(x)) - x).norm()
    had = (get("hadamard-int4", group_size=32).decode(get("hadamard-int4", group_size=32).encode(x)) - x).norm()
    assert had < 0.5 * plain


def test_options_validated():
    with pytest.raises(ValueError, match="seed"):
        get("hadamard-int4", seed=1.5)
    with pytest.raises(ValueError, match="group_size"):
        get("hadamard-int4", group_size=0)
    with pytest.raises(ValueError, match="group_size=48"):
        get("hadamard-int4", group_size=48).encode(torch.randn(1, 1, 1, 64))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([4, 2]),
    bands=st.sampled_from([1, 2, 8, 32]),
    outliers=st.booleans(),
    mix=st.floats(0.0, 1.0),
)
def test_tier_a_radius_bounds_logit_error_for_adversarial_queries(seed, bits, bands, outliers, mix):
    """Per cell: the store's witness of the served keys bounds |sc·q·(k̂ − k)| for queries aligned with the residual
    (the Cauchy–Schwarz equality direction, band by band) mixed with random ones."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 16, 64, generator=gen) * (1 + 50 * torch.rand(1, generator=gen))
    if outliers:
        x[..., [1, 33, 62]] *= 40.0
    codec = get(f"hadamard-int{bits}", seed=seed)
    qz = quantize(codec, x, bands=bands)
    delta = qz.x_hat.to(torch.float64) - x.to(torch.float64)
    rnd = torch.randn(1, 2, 16, 64, generator=gen, dtype=torch.float64)
    q = mix * delta / delta.norm(dim=-1, keepdim=True).clamp(min=1e-30) + (1 - mix) * rnd / 8
    sc = 1.0 / math.sqrt(64)
    for t in range(16):
        c = tier_a_radius(q[:, :, t], qz.band_norms, sc)  # [1, 2, 16] radii of every token
        err = (sc * q[:, :, t : t + 1] @ delta.transpose(-1, -2)).abs().squeeze(-2)
        assert bool((err <= c * (1 + 1e-12) + 1e-300).all())
    assert torch.allclose(qz.band_norms, band_norms(delta, bands))


def test_codec_forms_sound_in_every_cell_of_the_ci_fuzz():
    """>= 2·10^5 adversarial end-to-end cells per codec form: radius >= |ε_t| per token, meter >= TV per cell."""
    gen = torch.Generator().manual_seed(16)
    for codec in CODEC_FORMS:
        n_cells, tight = 0, 0.0
        for _ in range(2):
            for s, rows in CODEC_PLAN:
                cells = make_codec_cells(codec, rows, s, gen)
                assert violations(cells) == (0, 0), codec
                n_cells += rows
                ratio = cells.eps.abs() / cells.radius.clamp(min=1e-300)
                tight = max(tight, float(ratio.max()))
        assert n_cells >= 200_000
        assert tight > 0.999  # the aligned queries reach the Cauchy–Schwarz equality case: the fuzz is adversarial
