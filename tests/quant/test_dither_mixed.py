"""``dither-mixed``: per-head dithered widths in one codec (the key codec of a bit allocation)."""

from __future__ import annotations

import pytest
import torch
from quant_cases import fp16_exact, ulp32, with_outlier_channels

from kvcert.quant import bytes_per_token_head, get, sample_key
from kvcert.quant.dither import DitherCodec
from kvcert.quant.scales import per_group

WIDTHS = (8, 5, 3, 8, 6, 4)


def test_each_head_is_the_uniform_codec_of_its_width_bit_for_bit():
    """Head ``h`` stores, steps and decodes exactly what ``dither-int{b_h}`` gives that head of the same tensor under
    the same key (the same dither draw: the head index stays in the counter)."""
    x = with_outlier_channels(2, len(WIDTHS), 24, 64, seed=3)
    key = sample_key(x, seed=9, layer=4)
    mixed = DitherCodec(head_bits=WIDTHS)
    packed = mixed.encode(x, key)
    decoded = mixed.decode(packed, key)
    codes, steps = mixed.codes(packed), mixed.steps(packed)
    for h, b in enumerate(WIDTHS):
        uniform = get(f"dither-int{b}")
        ref = uniform.encode(x, key)
        assert torch.equal(decoded[:, h], uniform.decode(ref, key)[:, h])
        assert torch.equal(codes[:, h], uniform.codes(ref)[:, h])
        assert torch.equal(steps[:, h], uniform.steps(ref)[:, h])
        q = 2 ** (b - 1) - 1
        assert int(codes[:, h].abs().max()) <= q
    s = per_group(steps, 32).to(torch.float64)
    assert bool(((decoded.to(torch.float64) - x.to(torch.float64)).abs() <= s / 2 + ulp32(x)).all())


def test_codes_are_stored_per_width_at_that_width():
    x = fp16_exact(1, len(WIDTHS), 8, 64, seed=1)
    packed = DitherCodec(head_bits=WIDTHS).encode(x, sample_key(x))
    assert packed.codec == "dither-mixed[8,5,3,8,6,4]"
    assert packed.heads == {"codes8": (0, 3), "codes6": (4,), "codes5": (1,), "codes4": (5,), "codes3": (2,)}
    for name, heads in packed.heads.items():
        b = int(name.removeprefix("codes"))
        t = packed.tensors[name]
        assert t.shape == (1, len(heads), 8, 64 * b // 8)
        assert t.dtype == (torch.int8 if b == 8 else torch.uint8)
    assert packed.tensors["scales"].shape == (1, len(WIDTHS), 8, 2)
    per_head = sum(bytes_per_token_head(get(f"dither-int{b}")) for b in WIDTHS) / len(WIDTHS)
    assert bytes_per_token_head(DitherCodec(head_bits=WIDTHS)) == per_head
    assert DitherCodec(head_bits=WIDTHS).bits == sum(WIDTHS) / len(WIDTHS)


@pytest.mark.parametrize("kernel", ["torch", "numba"])
def test_fused_round_trip_equals_encode_then_decode(kernel, monkeypatch):
    monkeypatch.setenv("KVCERT_KERNEL", kernel)
    x = with_outlier_channels(2, len(WIDTHS), 16, 64, seed=5)
    key = sample_key(x, seed=2)
    codec = DitherCodec(head_bits=WIDTHS)
    packed, decoded = codec.encode_decode(x, key)
    ref = codec.encode(x, key)
    assert packed.heads == ref.heads
    assert all(torch.equal(packed.tensors[n], ref.tensors[n]) for n in ref.tensors)
    assert torch.equal(decoded.view(torch.int32), codec.decode(ref, key).view(torch.int32))


def test_bad_widths_and_head_counts_are_refused():
    with pytest.raises(ValueError, match="bits must be one of"):
        DitherCodec(head_bits=(8, 7))
    with pytest.raises(ValueError, match="bits must be one of"):
        DitherCodec(head_bits=())
    with pytest.raises(ValueError, match="bits must be one of"):
        DitherCodec(head_bits=(8, True))
    codec = DitherCodec(head_bits=(8, 6, 5))
    x = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="built for 3 heads, got a tensor of 2 heads"):
        codec.encode(x, sample_key(x))
    y = torch.randn(1, 3, 4, 64)
    packed = codec.encode(y, sample_key(y))
    with pytest.raises(ValueError, match="written by codec"):
        DitherCodec(head_bits=(8, 6, 6)).decode(packed, sample_key(y))
