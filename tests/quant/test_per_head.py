"""``mixed[...]``: one member codec per head (the value codec of a per-(layer, KV head) allocation)."""

from __future__ import annotations

import pytest
import torch
from quant_cases import fp16_exact, ulp32

from kvcert.quant import bytes_per_token_head, resolve
from kvcert.quant.per_head import PerHeadCodec
from kvcert.quant.scales import per_group

MEMBERS = ("int8", "kivi-2", "int2", "int8", "int4", "fp8-e4m3")


def test_each_head_is_its_member_codec_bit_for_bit():
    """Head ``h`` decodes exactly what member ``c_h`` gives that head of the same tensor, and stores exactly the
    member's tensors of it."""
    x = fp16_exact(2, len(MEMBERS), 20, 64, seed=4, scale=3.0)
    codec = PerHeadCodec(MEMBERS)
    packed = codec.encode(x)
    decoded = codec.decode(packed)
    assert codec.name == "mixed[int8,kivi-2,int2,int8,int4,fp8-e4m3]" and codec.heads == len(MEMBERS)
    for h, name in enumerate(MEMBERS):
        member = resolve(name, "value")
        ref = member.encode(x[:, [h]])
        assert torch.equal(decoded[:, h], member.decode(ref)[:, 0])
        own = codec.member_packed(packed, name)
        for t, want in ref.tensors.items():
            i = packed.heads[f"{name}/{t}"].index(h)
            assert torch.equal(own.tensors[t][:, i], want[:, 0])


def test_rtn_heads_keep_the_half_step_bound():
    x = fp16_exact(1, 3, 32, 64, seed=2, scale=5.0)
    codec = PerHeadCodec(("int4", "int2", "int8"))
    packed = codec.encode(x)
    err = (codec.decode(packed).to(torch.float64) - x.to(torch.float64)).abs()
    for h, name in enumerate(("int4", "int2", "int8")):
        s = per_group(codec.member_packed(packed, name).tensors["scales"], 32).to(torch.float64)[:, 0]
        assert bool((err[:, h] <= s / 2 + ulp32(x[:, h])).all()), name


def test_bytes_are_the_members_stored_tensors():
    codec = PerHeadCodec(MEMBERS)
    x = fp16_exact(1, len(MEMBERS), 8, 64, seed=1)
    packed = codec.encode(x)
    assert packed.nbytes == sum(resolve(m, "value").encode(x[:, [h]]).nbytes for h, m in enumerate(MEMBERS))
    per_head = sum(bytes_per_token_head(resolve(m, "value")) for m in MEMBERS) / len(MEMBERS)
    assert bytes_per_token_head(codec) == per_head
    assert codec.residual_window == resolve("kivi-2", "value").residual_window > 0
    assert codec.bits == sum(resolve(m, "value").bits for m in MEMBERS) / len(MEMBERS)


def test_round_trip_equals_encode_then_decode():
    x = fp16_exact(2, len(MEMBERS), 16, 64, seed=5)
    codec = PerHeadCodec(MEMBERS)
    packed, decoded = codec.encode_decode(x)
    ref = codec.encode(x)
    assert packed.heads == ref.heads and set(packed.tensors) == set(ref.tensors)
    assert all(torch.equal(packed.tensors[n], ref.tensors[n]) for n in ref.tensors)
    assert torch.equal(decoded, codec.decode(ref))


def test_bad_members_and_inputs_are_refused():
    with pytest.raises(ValueError, match="one member codec per head"):
        PerHeadCodec(())
    with pytest.raises(ValueError, match="must be keyless"):
        PerHeadCodec(("int8", "dither-int4"))
    with pytest.raises(ValueError, match="must be keyless"):
        PerHeadCodec(("int8", "kivi-2"), axis="key")  # KIVI keys encode blocks of tokens
    with pytest.raises(ValueError, match="must be keyless"):
        PerHeadCodec(("int8", PerHeadCodec(("int4",))))
    with pytest.raises(ValueError, match="unknown codec"):
        PerHeadCodec(("int8", "int9"))
    with pytest.raises(ValueError, match="axis"):
        PerHeadCodec(("int8",), axis="both")
    codec = PerHeadCodec(("int8", "int4"))
    with pytest.raises(ValueError, match="built for 2 heads, got a tensor of 3 heads"):
        codec.encode(torch.randn(1, 3, 4, 64))
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(torch.full((1, 2, 4, 64), float("nan")))
    packed = codec.encode(torch.randn(1, 2, 4, 64))
    with pytest.raises(ValueError, match="written by codec"):
        PerHeadCodec(("int4", "int8")).decode(packed)
    with pytest.raises(ValueError, match="no tensors of member 'int2'"):
        codec.member_packed(packed, "int2")
