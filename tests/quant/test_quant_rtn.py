import pytest
import torch
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.quant import get
from kvcert.quant.rtn import QMAX
from kvcert.quant.scales import per_group


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group_size", [32, 16])
def test_rtn_error_at_most_half_scale_per_element(bits, group_size):
    codec = get(f"int{bits}", group_size=group_size)
    for x in (
        fp16_exact(2, 3, 16, 64, seed=bits),
        with_outlier_channels(seed=bits),
        torch.randn(1, 2, 8, 64) * 1e-3,
    ):
        packed = codec.encode(x)
        s = per_group(packed.tensors["scales"], group_size).to(torch.float64)
        err = (codec.decode(packed).to(torch.float64) - x.to(torch.float64)).abs()
        assert bool((err <= s / 2 + ulp32(x)).all()), float((err - s / 2).max())
        codes = codec.codes(packed)
        assert int(codes.abs().max()) <= QMAX[bits]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_rtn_scale_is_amax_over_qmax_rounded_up_and_hits_qmax(bits):
    codec = get(f"int{bits}")
    x = fp16_exact(1, 2, 8, 64, seed=3)
    packed = codec.encode(x)
    amax = x.unflatten(-1, (2, 32)).abs().amax(-1)
    s = packed.tensors["scales"]
    assert s.dtype == torch.float16
    exact = amax.to(torch.float64) / QMAX[bits]
    assert bool((s.to(torch.float64) >= exact).all())
    assert bool((s.to(torch.float64) <= exact * (1 + 2.0**-10)).all())
    # s ≤ amax/qmax·(1 + 2^-10) so the amax entry of each group still rounds to ±qmax (full range used)
    assert int(codec.codes(packed).abs().amax()) == QMAX[bits]


@pytest.mark.parametrize(("bits", "code_bytes"), [(8, 64), (4, 32), (2, 16)])
def test_rtn_bytes_per_token_head_from_tensors(bits, code_bytes):
    codec = get(f"int{bits}")
    x = fp16_exact(2, 3, 5, 64)
    packed = codec.encode(x)
    assert packed.nbytes == 2 * 3 * 5 * (code_bytes + 4)
    assert packed.tensors["codes"].dtype == (torch.int8 if bits == 8 else torch.uint8)


def test_int2_levels_are_symmetric_three_point():
    codec = get("int2")
    x = fp16_exact(1, 1, 4, 64, seed=9)
    packed = codec.encode(x)
    assert set(codec.codes(packed).unique().tolist()) <= {-1, 0, 1}
    zero = codec.decode(codec.encode(torch.zeros(1, 1, 1, 64)))
    assert torch.equal(zero, torch.zeros(1, 1, 1, 64))


def test_rtn_rejects_group_size_not_dividing_d():
    with pytest.raises(ValueError, match="group_size"):
        get("int8", group_size=48).encode(torch.randn(1, 1, 2, 64))
    with pytest.raises(ValueError, match="group_size"):
        get("int8", group_size=0)


def test_rtn_rejects_input_beyond_fp16_scale_range():
    x = torch.full((1, 1, 1, 64), 1e7)
    with pytest.raises(ValueError, match="fp16 range"):
        get("int8").encode(x)
