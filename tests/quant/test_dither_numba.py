"""The fused keyed dither (:mod:`kvcert.quant.dither_numba`) equals the tensor form of
:func:`kvcert.quant.dither.keyed_uniform` bit for bit, per element, over the whole int64 range of the key's fields,
and the codec takes it on CPU only on the numba backend."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.quant import dither, dither_numba, get, kernel_env
from kvcert.quant.base import DitherKey


def _tensor_form(key: DitherKey, shape: tuple[int, ...]) -> torch.Tensor:
    return dither.dither_from_state(dither.keyed_state(key, shape[1]), shape[3])


@pytest.mark.parametrize(
    ("seed", "layer"), [(0, 0), (1, 29), (-1, 3), (2**63 - 1, -(2**63)), (-(2**62) - 7, 2**40 + 3)]
)
@pytest.mark.parametrize("shape", [(2, 3, 5, 64), (1, 1, 1, 7), (3, 2, 16, 32)])
def test_fused_dither_equals_the_tensor_form_per_element(seed, layer, shape):
    gen = torch.Generator().manual_seed(abs(seed) % 1000 + shape[2])
    b, _, t, _ = shape
    request = torch.randint(-(2**63), 2**63 - 1, (b,), generator=gen, dtype=torch.int64)
    positions = torch.randint(-(2**63), 2**63 - 1, (b, t), generator=gen, dtype=torch.int64)
    positions[0] = torch.arange(t)  # ordinary positions too
    key = DitherKey(seed, request, layer, positions)
    got = dither_numba.keyed_uniform(seed, request, layer, positions, shape[1], shape[3])
    want = _tensor_form(key, shape)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_codec_round_trip_is_the_same_on_both_backends(kernel, monkeypatch):
    """The dithered codec's codes and decoded values do not depend on which form drew the dither; under
    ``KVCERT_KERNEL=torch`` the fused form is not called."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 6, 64, generator=gen)
    key = DitherKey(9, torch.tensor([5, -2]), 4, torch.arange(12).view(2, 6) + 100)
    codec = get("dither-int8")
    monkeypatch.setenv(kernel_env.ENV, "torch")
    ref = codec.encode(x, key=key)
    ref_x = codec.decode(ref, key=key)
    monkeypatch.setenv(kernel_env.ENV, kernel)
    calls = []
    fused = dither_numba.keyed_uniform
    monkeypatch.setattr(dither_numba, "keyed_uniform", lambda *a: calls.append(1) or fused(*a))
    got = codec.encode(x, key=key)
    got_x = codec.decode(got, key=key)
    assert all(torch.equal(got.tensors[n], ref.tensors[n]) for n in ref.tensors)
    assert torch.equal(got_x.view(torch.int32), ref_x.view(torch.int32))
    assert len(calls) == (2 if kernel == "numba" else 0)


@pytest.mark.parametrize("codec_name", ["dither-int8", "dither-int6", "dither-int5", "dither-int4", "dither-int3"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (1, 2, 5, 32), (3, 1, 1, 128)])
def test_fused_round_trip_equals_encode_then_decode_per_element(codec_name, shape, monkeypatch):
    """:meth:`DitherCodec.encode_decode` on the numba backend (one compiled pass, one draw) stores the codes and
    steps, and decodes to the values, that :meth:`encode` then :meth:`decode` give on the tensor path, bit for bit
    per element: over magnitudes from 1e-30 to 6e4 (clamped to the fp16 range), all-zero groups and single-channel
    outliers."""
    gen = torch.Generator().manual_seed(sum(shape) + len(codec_name))
    b, _, t, _ = shape
    scale = torch.logspace(-30, 4.7, shape[2]).view(1, 1, -1, 1)
    x = (torch.randn(shape, generator=gen) * scale).clamp(-6e4, 6e4)  # fp16-range keys: every step fits fp16
    x[0, 0, 0, :32] = 0.0  # an all-zero group (step 0)
    x[-1, -1, -1, 3] = 6e4  # an outlier dominating its group
    key = DitherKey(7, torch.arange(b) * 13 - 4, 2, torch.arange(b * t).view(b, t) + 1000)
    codec = get(codec_name)
    monkeypatch.setenv(kernel_env.ENV, "torch")
    ref = codec.encode(x, key=key)
    ref_x = codec.decode(ref, key=key)
    monkeypatch.setenv(kernel_env.ENV, "numba")
    calls = []
    fused = dither_numba.round_trip
    monkeypatch.setattr(dither_numba, "round_trip", lambda *a: calls.append(1) or fused(*a))
    got, got_x = codec.encode_decode(x, key=key)
    assert calls == [1]
    assert got.codec == ref.codec and got.shape == ref.shape and got.tensors.keys() == ref.tensors.keys()
    for name, want in ref.tensors.items():
        have = got.tensors[name]
        assert have.dtype == want.dtype and torch.equal(have, want), name
    assert got_x.dtype == ref_x.dtype == torch.float32
    assert torch.equal(got_x.view(torch.int32), ref_x.view(torch.int32))  # -0.0 and 0.0 told apart


def test_fused_round_trip_rounds_ties_to_even_and_zero_steps_to_the_dither():
    """The kernel's rounding is the tensor form's (``torch.round``: ties to even) and a zero step reads ``x/s`` as 0
    (the code is the rounded dither, the value ``0·(code − u)`` with its sign)."""
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 126.5, -126.5, 3.0, 7.0, -5.0, -0.25]])
    u = torch.zeros_like(x)
    u[0, 9:12] = torch.tensor([0.5, -0.5, 0.25])
    s = torch.ones(1, 13, dtype=torch.float16)
    code, x_hat = dither_numba.round_trip(x, u, s, 1)
    v = x.double() + u.double()
    assert torch.equal(code, torch.round(v).to(torch.int8))
    assert code.tolist()[0] == [0, 2, 2, 0, -2, -2, 0, 126, -126, 4, 6, -5, 0]
    decoded = (code.double() - u.double()).to(torch.float32)  # the codec's decode, from the stored codes
    assert torch.equal(x_hat.view(torch.int32), decoded.view(torch.int32))  # round(−0.25) = −0 is served as +0
    zero_code, zero_hat = dither_numba.round_trip(x, torch.full_like(x, -0.25), torch.zeros_like(s), 1)
    assert torch.equal(zero_code, torch.zeros_like(zero_code))
    assert torch.equal(zero_hat.view(torch.int32), torch.zeros_like(x).view(torch.int32))  # 0·(0 + 0.25) = +0.0


def test_fused_round_trip_refuses_bad_shapes():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="round_trip"):
        dither_numba.round_trip(x, torch.zeros(2, 64), torch.zeros(2, 3), 32)
    with pytest.raises(ValueError, match="round_trip"):
        dither_numba.round_trip(x.double(), torch.zeros(2, 64), torch.zeros(2, 2), 32)
    with pytest.raises(ValueError, match="round_trip"):
        dither_numba.round_trip(x, torch.zeros(2, 63), torch.zeros(2, 2), 32)


def test_encode_decode_keeps_the_checks_and_the_tensor_path_off_numba(monkeypatch):
    """``encode_decode`` refuses what ``encode`` refuses; under ``KVCERT_KERNEL=torch`` the kernel is not called."""
    codec = get("dither-int8")
    x = torch.randn(1, 1, 2, 64)
    with pytest.raises(ValueError, match="DitherKey"):
        codec.encode_decode(x)
    bad = x.clone()
    bad[0, 0, 1, 0] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode_decode(bad, key=DitherKey(0, torch.tensor([1]), 0, torch.arange(2).view(1, 2)))
    monkeypatch.setenv(kernel_env.ENV, "torch")
    monkeypatch.setattr(dither_numba, "round_trip", lambda *a: pytest.fail("the fused round trip ran"))
    packed, x_hat = codec.encode_decode(x, key=DitherKey(0, torch.tensor([1]), 0, torch.arange(2).view(1, 2)))
    assert torch.equal(x_hat, codec.decode(packed, key=DitherKey(0, torch.tensor([1]), 0, torch.arange(2).view(1, 2))))
