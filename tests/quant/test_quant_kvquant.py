import math

import pytest
import torch
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.quant import get


def test_kvquant_dense_error_bound_and_exact_outliers():
    codec = get("kvquant-4")
    for x in (fp16_exact(2, 2, 64, 64, seed=1), with_outlier_channels(seed=2)):
        packed = codec.encode(x)
        x_hat = codec.decode(packed)
        k = codec.n_outliers(64)
        flat = x.unflatten(-2, (2, 32)).flatten(-2)
        top = flat.abs().topk(k, dim=-1).indices
        is_out = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, top, True).unflatten(-1, (32, 64))
        is_out = is_out.flatten(-3, -2)
        scale = packed.tensors["scales"].to(torch.float64).repeat_interleave(32, dim=-2)
        err = (x_hat.to(torch.float64) - x.to(torch.float64)).abs()
        assert bool((err[is_out] == 0).all())  # fp16-exact input: outliers stored exactly
        assert bool((err[~is_out] <= (scale / 2 + ulp32(x))[~is_out]).all())


def test_kvquant_outliers_are_excluded_from_channel_range():
    x = fp16_exact(1, 1, 32, 64, seed=3)
    x[0, 0, 5, 9] = 1000.0  # a single huge entry: becomes a sparse outlier
    packed = get("kvquant-4").encode(x)
    assert float(packed.tensors["scales"][0, 0, 0, 9]) < 1.0
    assert 1000.0 in packed.tensors["outlier_values"].to(torch.float32).flatten().tolist()


def test_kvquant_bytes_from_tensors():
    packed = get("kvquant-4").encode(fp16_exact(1, 2, 64, 64))
    k = math.ceil(0.01 * 32 * 64)
    per_block = 32 * 64 // 2 + 2 * 64 * 2 + k * (2 + 2)
    assert packed.nbytes == 2 * 2 * per_block
    assert packed.tensors["outlier_index"].dtype == torch.int16
    assert packed.tensors["outlier_values"].dtype == torch.float16


def test_kvquant_validates_options():
    with pytest.raises(ValueError, match="outlier_frac"):
        get("kvquant-4", outlier_frac=1.5)
    with pytest.raises(ValueError, match="block"):
        get("kvquant-4", block=0)
