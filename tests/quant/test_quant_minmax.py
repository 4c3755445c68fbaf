import pytest
import torch
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.quant import get
from kvcert.quant.kivi import KiviCodec
from kvcert.quant.minmax import MinMaxCodec
from kvcert.quant.token_tiers import check_wide


@pytest.mark.parametrize("bits", [2, 4])
def test_minmax_error_at_most_half_scale_per_token_and_group(bits):
    codec = get(f"minmax-int{bits}")
    assert codec.name == f"minmax-int{bits}" and codec.block == 1 and codec.residual_window == 0
    for x in (fp16_exact(2, 2, 40, 64, seed=bits), with_outlier_channels(seed=bits), fp16_exact(1, 1, 7, 128) - 3):
        packed = codec.encode(x)
        assert packed.tensors["scales"].shape == (*x.shape[:3], x.shape[-1] // 64)  # one scale per 64 channels
        scale = codec.expand(packed.tensors["scales"], x.shape[-1]).to(torch.float64)
        zero = codec.expand(packed.tensors["zeros"], x.shape[-1])
        x64 = x.to(torch.float64)
        assert bool((zero <= x64).all()) and bool((zero + ((1 << bits) - 1) * scale >= x64).all())
        err = (codec.decode(packed).to(torch.float64) - x64).abs()
        assert bool((err <= scale / 2 + ulp32(x) + ulp32(zero)).all())


def test_minmax_group_is_the_whole_head_below_64_channels():
    x = fp16_exact(1, 1, 5, 32, seed=2)
    packed = get("minmax-int2").encode(x)
    assert packed.tensors["scales"].shape == (1, 1, 5, 1)
    err = (get("minmax-int2").decode(packed) - x).abs().to(torch.float64)
    assert bool((err <= packed.tensors["scales"].to(torch.float64) / 2 + ulp32(x) + 1e-3).all())
    with pytest.raises(ValueError, match="divide the head dimension"):
        get("minmax-int2").encode(fp16_exact(1, 1, 2, 96))


def test_minmax_bytes_at_head_dim_64_match_int2():
    x = fp16_exact(1, 3, 16, 64, seed=3)
    two, four = get("minmax-int2").encode(x), get("minmax-int4").encode(x)
    per_token = 3 * 16
    assert two.nbytes / per_token == 20 == get("int2").encode(x).nbytes / per_token  # 16 B codes + fp16 scale, zero
    assert four.nbytes / per_token == 36


def test_minmax_tokens_encode_on_their_own():
    """Each token's codes depend on that token alone: encoding a token alone or among others gives the same codes,
    which token tiers and upgrades need (``check_wide`` accepts it; KIVI's residual window is refused)."""
    codec = get("minmax-int2")
    x = fp16_exact(1, 2, 9, 64, seed=11)
    whole = codec.decode(codec.encode(x))
    for t in range(9):
        assert torch.equal(codec.decode(codec.encode(x[:, :, t : t + 1])), whole[:, :, t : t + 1])
    check_wide(codec, codec, "a light value codec")
    with pytest.raises(ValueError, match="residual window"):
        check_wide(codec, KiviCodec(2, axis="value"), "a heavy value codec")


def test_minmax_rejects_other_widths_and_bad_groups():
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        MinMaxCodec(8)
    with pytest.raises(ValueError, match="group_size"):
        get("minmax-int4", group_size=0)
