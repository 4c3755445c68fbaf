"""The fused RTN round trip (:mod:`kvcert.quant.rtn_numba`) stores and decodes to what the tensor form of
:class:`kvcert.quant.rtn.RTNCodec` does, bit for bit per element, and the codec takes it on CPU only on the numba
backend."""

from __future__ import annotations

import pytest
import torch

from kvcert.quant import get, kernel_env, rtn_numba


@pytest.mark.parametrize("codec_name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (1, 2, 5, 32), (3, 1, 1, 128)])
def test_fused_round_trip_equals_encode_then_decode_per_element(codec_name, shape, monkeypatch):
    """:meth:`RTNCodec.encode_decode` on the numba backend gives the codes, steps and decoded values of
    :meth:`encode` then :meth:`decode` on the tensor path, bit for bit per element, over magnitudes from 1e-30 to
    6e4, all-zero groups, single-channel outliers and exact ties of ``x/s``."""
    gen = torch.Generator().manual_seed(sum(shape) + len(codec_name))
    x = torch.randn(shape, generator=gen) * torch.logspace(-30, 4, shape[2]).view(1, 1, -1, 1)
    x[0, 0, 0, :32] = 0.0  # an all-zero group (step 0)
    x[-1, -1, -1, 3] = 6e4  # an outlier dominating its group
    codec = get(codec_name)
    qm = min(codec.qmax, 12)
    ties = torch.arange(-qm, qm, dtype=torch.float32) + 0.5  # x/s on a tie, s = 1 in this group (fp16)
    x[0, -1, -1, :32] = -0.25  # round(−0.25) = −0 (stored and served as +0)
    x[0, -1, -1, : ties.numel()] = ties
    x[0, -1, -1, 31] = float(codec.qmax)  # the group's amax: s = amax/qmax = 1
    monkeypatch.setenv(kernel_env.ENV, "torch")
    ref = codec.encode(x)
    ref_x = codec.decode(ref)
    monkeypatch.setenv(kernel_env.ENV, "numba")
    calls = []
    fused = rtn_numba.round_trip
    monkeypatch.setattr(rtn_numba, "round_trip", lambda *a: calls.append(1) or fused(*a))
    got, got_x = codec.encode_decode(x)
    assert calls == [1]
    assert got.codec == ref.codec and got.shape == ref.shape and got.tensors.keys() == ref.tensors.keys()
    assert float(ref.tensors["scales"][0, -1, -1, 0]) == 1.0  # the ties are ties
    for name, want in ref.tensors.items():
        have = got.tensors[name]
        assert have.dtype == want.dtype and torch.equal(have, want), name
    assert got_x.dtype == ref_x.dtype == torch.float32
    assert torch.equal(got_x.view(torch.int32), ref_x.view(torch.int32))  # −0.0 and 0.0 told apart


def test_fused_round_trip_refuses_bad_shapes_and_stays_off_the_tensor_path(monkeypatch):
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="round_trip"):
        rtn_numba.round_trip(x, torch.zeros(2, 3), 32)
    with pytest.raises(ValueError, match="round_trip"):
        rtn_numba.round_trip(x.double(), torch.zeros(2, 2), 32)
    with pytest.raises(ValueError, match="round_trip"):
        rtn_numba.round_trip(x, torch.zeros(2, 2, dtype=torch.int32), 32)
    codec = get("int4")
    with pytest.raises(ValueError, match="blocks|shape"):
        codec.encode_decode(torch.zeros(2, 64))
    monkeypatch.setenv(kernel_env.ENV, "torch")
    monkeypatch.setattr(rtn_numba, "round_trip", lambda *a: pytest.fail("the fused round trip ran"))
    y = torch.randn(1, 2, 3, 64)
    packed, y_hat = codec.encode_decode(y)
    assert torch.equal(y_hat, codec.decode(packed))
