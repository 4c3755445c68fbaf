import pytest
import torch
from quant_cases import fp16_exact

from kvcert.bounds.rope import band_norms
from kvcert.quant import bytes_per_token_head, get, names, quantize, sample_key
from kvcert.quant.registry import BUILTINS


@pytest.mark.parametrize("name", list(BUILTINS))
@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_witnesses_consistent_with_residual(name, pairing):
    codec = get(name)
    x = fp16_exact(1, 2, 32, 64, seed=3)
    key = sample_key(x) if codec.needs_key else None
    q = quantize(codec, x, bands=4, pairing=pairing, key=key)
    delta = q.x_hat.to(torch.float64) - x.to(torch.float64)
    assert q.x_hat.dtype == torch.float32 and q.x_hat.shape == x.shape
    assert q.band_norms.dtype == torch.float64 and q.band_norms.shape == (1, 2, 32, 4)
    assert torch.equal(q.band_norms, band_norms(delta, 4, pairing))
    assert torch.allclose(q.residual_norms, delta.norm(dim=-1), rtol=1e-12, atol=0)
    assert torch.allclose((q.band_norms**2).sum(-1), q.residual_norms**2, rtol=1e-9, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_inputs_of_each_float_dtype_round_trip(dtype):
    x = fp16_exact(1, 1, 32, 64).to(dtype)
    q = quantize(get("int8"), x)
    assert q.x_hat.dtype == torch.float32
    assert torch.equal(q.x_hat, quantize(get("int8"), x.to(torch.float32)).x_hat)


@pytest.mark.parametrize("name", list(BUILTINS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_naming_the_problem(name, bad):
    codec = get(name)
    x = torch.randn(1, 1, 32, 64)
    x[0, 0, 3, 5] = bad
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(x, sample_key(x) if codec.needs_key else None)


def test_bad_shapes_and_types_rejected():
    codec = get("int8")
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        codec.encode(torch.randn(4, 64))
    with pytest.raises(ValueError, match="floating"):
        codec.encode(torch.ones(1, 1, 2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="torch.Tensor"):
        codec.encode([[1.0]])
    with pytest.raises(ValueError, match="written by codec 'int4'"):
        codec.decode(get("int4").encode(torch.randn(1, 1, 2, 64)))


def test_bytes_per_token_head_measured_at_d64():
    expected = {
        "none": 128,
        "int8": 68,
        "int4": 36,
        "int2": 20,
        "dither-int8": 68,
        "dither-int6": 52,  # 64 six-bit codes in 48 bytes + 2 fp16 steps
        "dither-int5": 44,
        "dither-int4": 36,  # two codes a byte: 32 + 2 fp16 steps
        "dither-int3": 28,  # 8 three-bit codes in 3 bytes: 24 + 2 fp16 steps
        "fp8-e4m3": 64,
        "fp8-e5m2": 64,
        "fp8-e4m3-scaled": 68,
        "fp8-e5m2-scaled": 68,
        "kivi-2": 24,
        "kivi-4": 40,
        "minmax-int2": 20,  # 16 B of codes + one fp16 scale and zero per 64 channels
        "minmax-int4": 36,
        "kvquant-4": (1024 + 256 + 21 * 4) / 32,
        "sign-1": 12,
        "hadamard-int4": 34,
        "hadamard-int2": 18,
    }
    assert set(expected) == set(BUILTINS)
    for name, value in expected.items():
        assert bytes_per_token_head(get(name), D=64) == value, name
    assert bytes_per_token_head(get("int8"), D=128) == 136  # docs/codecs.md#bytes
    assert bytes_per_token_head(get("int8", bypass=4), D=128) == 152
    with pytest.raises(ValueError, match="D must be"):
        bytes_per_token_head(get("int8"), D=0)
    assert len(names()) >= len(BUILTINS)
