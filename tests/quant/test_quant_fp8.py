import math

import pytest
import torch
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.quant import get
from kvcert.quant.fp8 import FP8_FORMATS, MANTISSA_BITS, fp8_max
from kvcert.quant.scales import per_group


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_raw_fp8_matches_torch_cast_in_range(fmt):
    codec = get(f"fp8-{fmt}")
    x = fp16_exact(2, 2, 16, 64, seed=1, scale=30.0)
    packed = codec.encode(x)
    assert packed.tensors["codes"].dtype == FP8_FORMATS[fmt]
    assert torch.equal(codec.decode(packed), x.to(FP8_FORMATS[fmt]).to(torch.float32))
    assert packed.nbytes == x.numel()  # 1 byte per element, no scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_raw_fp8_saturates_beyond_fmax(fmt):
    fmax = fp8_max(fmt)
    x = torch.zeros(1, 1, 1, 64)
    x[..., 0], x[..., 1] = 3 * fmax, -3 * fmax
    x_hat = get(f"fp8-{fmt}").decode(get(f"fp8-{fmt}").encode(x))
    assert x_hat[..., 0].item() == fmax and x_hat[..., 1].item() == -fmax
    assert bool(torch.isfinite(x_hat).all())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scaled_fp8_relative_error_bound_per_element(fmt):
    codec = get(f"fp8-{fmt}-scaled")
    m = MANTISSA_BITS[fmt]
    emin = int(math.log2(torch.finfo(FP8_FORMATS[fmt]).smallest_normal))  # least normal exponent
    for x in (fp16_exact(2, 2, 16, 64, seed=2), with_outlier_channels(seed=3)):
        packed = codec.encode(x)
        s = per_group(packed.tensors["scales"], 32).to(torch.float64)
        xs = x.to(torch.float64) / s
        bound = s * (2.0 ** -(m + 1) * xs.abs() + 2.0 ** (emin - m - 1)) + ulp32(x)
        err = (codec.decode(packed).to(torch.float64) - x.to(torch.float64)).abs()
        assert bool((err <= bound).all())
        assert bool((xs.abs() <= fp8_max(fmt)).all())  # never saturates
    assert packed.nbytes == x.numel() + 2 * x.numel() // 32


def test_scaled_beats_raw_on_small_values():
    x = fp16_exact(1, 2, 16, 64, seed=4, scale=1e-3)
    raw, scaled = get("fp8-e4m3"), get("fp8-e4m3-scaled")
    err_raw = (raw.decode(raw.encode(x)) - x).norm()
    err_scaled = (scaled.decode(scaled.encode(x)) - x).norm()
    assert err_scaled < 0.5 * err_raw
