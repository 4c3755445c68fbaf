import pytest
import torch
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.quant import get


def _params(codec, packed):
    d = packed.shape[-1]
    return codec.expand(packed.tensors["scales"], d).to(torch.float64), codec.expand(packed.tensors["zeros"], d)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["key", "value"])
def test_kivi_error_at_most_half_scale_per_element(bits, axis):
    codec = get(f"kivi-{bits}", axis=axis)
    for x in (
        fp16_exact(2, 2, 64, 64, seed=bits),
        with_outlier_channels(seed=bits),
        fp16_exact(1, 1, 32, 64) + 5,
    ):
        packed = codec.encode(x)
        scale, zero = _params(codec, packed)
        x64 = x.to(torch.float64)
        assert bool((zero <= x64).all()) and bool((zero + ((1 << bits) - 1) * scale >= x64).all())
        err = (codec.decode(packed).to(torch.float64) - x64).abs()
        assert bool((err <= scale / 2 + ulp32(x) + ulp32(zero)).all())


def test_kivi_key_statistics_are_per_channel_over_token_groups():
    codec = get("kivi-2")  # axis="key" by default
    assert codec.block == 32 and codec.residual_window == 32
    x = fp16_exact(1, 1, 64, 64, seed=5)
    x[0, 0, 40, 7] = 50.0  # one big entry in token group 1, channel 7
    packed = codec.encode(x)
    assert packed.tensors["scales"].shape == (1, 1, 2, 64)
    scales = packed.tensors["scales"].to(torch.float32)
    assert scales[0, 0, 1, 7] > 10 * scales[0, 0, 1, 6]  # only that channel in that group is affected
    assert scales[0, 0, 0, 7] < 2 * scales[0, 0, 0, 6] + 1e-3


def test_kivi_value_statistics_are_per_token_channel_groups():
    codec = get("kivi-4", axis="value")
    assert codec.block == 1
    x = fp16_exact(1, 1, 8, 64, seed=6)
    packed = codec.encode(x)
    assert packed.tensors["scales"].shape == (1, 1, 8, 2)


@pytest.mark.parametrize(
    ("name", "axis", "per_token_head"),
    [
        ("kivi-2", "value", 16 + 2 * 2 * 2),  # 2-bit codes + fp16 scale and zero per 32-channel group
        ("kivi-4", "value", 32 + 2 * 2 * 2),
        ("kivi-2", "key", 16 + 64 * 2 * 2 / 32),  # per-channel fp16 scale+zero shared by 32 tokens
        ("kivi-4", "key", 32 + 64 * 2 * 2 / 32),
    ],
)
def test_kivi_bytes_from_tensors(name, axis, per_token_head):
    packed = get(name, axis=axis).encode(fp16_exact(2, 2, 64, 64))
    assert packed.tensors["codes"].dtype == torch.uint8
    assert packed.nbytes == 2 * 2 * 64 * per_token_head


def test_kivi_key_requires_whole_token_groups_and_valid_options():
    with pytest.raises(ValueError, match="blocks of 32"):
        get("kivi-2").encode(torch.randn(1, 1, 40, 64))
    with pytest.raises(ValueError, match="axis"):
        get("kivi-2", axis="query")
    with pytest.raises(ValueError, match="residual_window"):
        get("kivi-4", residual_window=-1)
