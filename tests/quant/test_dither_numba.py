"""The fused keyed dither (:mod:`kvcert.quant.dither_numba`) equals the tensor form of
:func:`kvcert.quant.dither.keyed_uniform` bit for bit, per element, over the whole int64 range of the key's fields,
and the codec takes it on CPU only on the numba backend."""

from __future__ import annotations

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
