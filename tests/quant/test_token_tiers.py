"""The token-tier codec (``TokenTiers(light, heavy)``): each token decodes to what its own tier's codec decodes it to,
its Tier-B steps are its own tier's, each token's codes are stored once (bytes measured), and choices a rectangular
stored form cannot hold are refused by name."""

from __future__ import annotations

import pytest
import torch

from kvcert.quant import get, sample_key
from kvcert.quant.token_tiers import TokenTiers, check_wide

PAIRS = [("dither-int5", "dither-int8"), ("dither-int4+bypass2", "dither-int8+bypass2"), ("int2", "int4")]


def _choice(b=2, h=3, t=21, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    heavy = torch.zeros(b, h, t, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            heavy[i, j, torch.randperm(t, generator=g)[:k]] = True
    return heavy


def _x(t=21, seed=1):
    return torch.randn(2, 3, t, 64, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(("light", "heavy"), PAIRS)
def test_every_token_decodes_as_its_own_tiers_codec_decodes_it(light, heavy):
    codec = TokenTiers(get(light), get(heavy))
    x, choice = _x(), _choice()
    key = sample_key(x, seed=5) if codec.needs_key else None
    packed, decoded = codec.encode_decode_split(x, key, choice)
    # reference: each codec alone on the whole tensor (per-token codes: a token's codes depend on it alone)
    lo, hi = get(light), get(heavy)
    lx = lo.decode(lo.encode(x, key), key)
    if getattr(lo, "channels", None) is not None:
        hi.channels, hi.channel_mask = lo.channels, lo.channel_mask  # the heavy codec keeps the light's channels
    hx = hi.decode(hi.encode(x, key), key)
    want = torch.where(choice.unsqueeze(-1), hx, lx)
    assert torch.equal(decoded, want) and torch.equal(codec.decode(packed, key), want)  # every cell
    assert torch.equal(TokenTiers.heavy_mask(packed), choice)
    if codec.tier_b:
        steps = torch.where(choice.unsqueeze(-1), hi.steps(hi.encode(x, key)), lo.steps(lo.encode(x, key)))
        assert torch.equal(codec.steps(packed), steps)
    else:
        assert codec.steps(packed) is None


@pytest.mark.parametrize(("light", "heavy"), PAIRS)
def test_each_tokens_codes_are_stored_once(light, heavy):
    codec = TokenTiers(get(light), get(heavy))
    x = _x(t=40)
    key = sample_key(x) if codec.needs_key else None
    packed = codec.encode_split(x, key, _choice(t=40, k=8))
    lo, hi = get(light), get(heavy)
    light_bytes, heavy_bytes = lo.encode(x, key).nbytes, hi.encode(x, key).nbytes  # all 40 tokens in one codec
    mask_bytes = 2 * 3 * 5  # 40 tokens: 5 bytes of bits per (row, head)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in packed.tensors.values())
    assert packed.nbytes == light_bytes * 32 // 40 + heavy_bytes * 8 // 40 + mask_bytes
    assert packed.tensors["tier"].dtype == torch.uint8


def test_without_a_choice_every_token_is_light():
    codec = TokenTiers(get("dither-int5"), get("dither-int8"))
    x = _x()
    key = sample_key(x)
    packed = codec.encode(x, key)
    assert not TokenTiers.heavy_mask(packed).any()
    assert torch.equal(codec.decode(packed, key), get("dither-int5").decode(get("dither-int5").encode(x, key), key))


def test_choices_a_rectangular_form_cannot_hold_are_refused():
    codec = TokenTiers(get("int2"), get("int4"))
    x = _x()
    uneven = _choice()
    uneven[0, 0] = False
    with pytest.raises(ValueError, match="same number of heavy tokens"):
        codec.encode_split(x, None, uneven)
    with pytest.raises(ValueError, match=r"bool \[B, H, T\]"):
        codec.encode_split(x, None, _choice()[:, :, :5])
    with pytest.raises(ValueError, match=r"bool \[B, H, T\]"):
        codec.encode_split(x, None, _choice().to(torch.int64))
    with pytest.raises(AttributeError, match="light codec"):
        codec.channel_mask = None


def test_codecs_that_cannot_hold_single_tokens_or_miss_tier_b_are_refused():
    with pytest.raises(ValueError, match="block 1, no residual window"):
        TokenTiers(get("int2"), get("kivi-2"))  # a residual window: tokens wait in groups
    with pytest.raises(ValueError, match="block 1, no residual window"):
        TokenTiers(get("kivi-2"), get("int4"))
    with pytest.raises(ValueError, match="Tier-B steps"):
        TokenTiers(get("dither-int5"), get("int8"))  # no steps: the heavy tokens' Tier-B radius is undefined
    with pytest.raises(ValueError, match="Tier-B steps"):
        check_wide(get("dither-int5"), get("dither-int8", group_size=16), "a wide codec")
    with pytest.raises(ValueError, match="Tier-B steps"):
        TokenTiers(get("dither-int5+bypass2"), get("dither-int8"))  # different bypassed channels
