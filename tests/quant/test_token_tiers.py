"""The token-tier codec (``TokenTiers(light, heavy)``): each token decodes to what its own tier's codec decodes it to,
its Tier-B steps are its own tier's, each token's codes are stored once (bytes measured), each (row, head) may have
its own heavy count, dropped codes decode to NaN and come back bit for bit, and bad choices are refused by name."""

from __future__ import annotations

import pytest
import torch

from kvcert.quant import get, sample_key
from kvcert.quant.token_tiers import TokenTiers, check_wide

PAIRS = [("dither-int5", "dither-int8"), ("dither-int4+bypass2", "dither-int8+bypass2"), ("int2", "int4")]


def _choice(b=2, h=3, t=21, k=5, seed=0, uneven=False):
    """``k`` heavy tokens per (row, head) at random slots (``uneven``: ``(i + j) % (k + 1)`` instead)."""
    g = torch.Generator().manual_seed(seed)
    heavy = torch.zeros(b, h, t, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            heavy[i, j, torch.randperm(t, generator=g)[: (i + j) % (k + 1) if uneven else k]] = True
    return heavy


def _x(t=21, seed=1):
    return torch.randn(2, 3, t, 64, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize(("light", "heavy"), PAIRS)
def test_every_token_decodes_as_its_own_tiers_codec_decodes_it(light, heavy, uneven):
    codec = TokenTiers(get(light), get(heavy))
    x, choice = _x(), _choice(uneven=uneven)
    assert len(set(choice.sum(-1).flatten().tolist())) == (4 if uneven else 1)  # counts 0..3 per (row, head)
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


@pytest.mark.parametrize(("light", "heavy"), PAIRS)
def test_dropped_codes_decode_to_nan_free_their_bytes_and_come_back_bit_for_bit(light, heavy):
    codec = TokenTiers(get(light), get(heavy))
    x, choice = _x(), _choice(uneven=True)
    key = sample_key(x, seed=3) if codec.needs_key else None
    packed, decoded = codec.encode_decode_split(x, key, choice)
    which = torch.zeros_like(choice)
    which[0, 1, [0, 4, 9]] = True  # light and heavy entries of one head
    which[1, 2, 20] = True
    which[1, 2, choice[1, 2].nonzero().view(-1)[:1]] = True
    dropped = codec.drop(packed, which)
    assert torch.equal(TokenTiers.dropped_mask(dropped), which)
    assert torch.equal(TokenTiers.heavy_mask(dropped), choice)
    out = codec.decode(dropped, key)
    assert bool(out[which].isnan().all()) and torch.equal(out[~which], decoded[~which])  # every other cell as before
    if codec.tier_b:
        steps = codec.steps(dropped)
        assert bool(steps[which].isnan().all()) and torch.equal(steps[~which], codec.steps(packed)[~which])
    # the bytes: the dropped entries' codes are gone, a second bit mask (3 bytes per (row, head) for 21 slots) is added
    full_light = get(light).encode(x, key).nbytes // (2 * 3 * 21)
    full_heavy = (codec.heavy.encode(x, key).nbytes) // (2 * 3 * 21)
    n_light, n_heavy = int((which & ~choice).sum()), int((which & choice).sum())
    assert dropped.nbytes == packed.nbytes - n_light * full_light - n_heavy * full_heavy + 2 * 3 * 3
    # given back: bit for bit the form before the drop (x outside the restored entries is not read)
    x_other = torch.where(which.unsqueeze(-1), x, torch.zeros_like(x))
    back = codec.restore(dropped, x_other, key, which)
    assert back.tensors.keys() == packed.tensors.keys()
    assert all(torch.equal(back.tensors[n], packed.tensors[n]) for n in packed.tensors)
    # a part at a time, and a drop of a dropped entry keeps it dropped
    part = which.clone()
    part[1] = False
    half = codec.restore(codec.drop(dropped, part), x, key, part)
    assert torch.equal(TokenTiers.dropped_mask(half), which & ~part)
    with pytest.raises(ValueError, match="dropped entries only"):
        codec.restore(half, x, key, which)
    with pytest.raises(ValueError, match=r"which must be a bool \[B, H, T\]"):
        codec.drop(packed, which[:, :, :3])


def test_bad_choices_are_refused():
    codec = TokenTiers(get("int2"), get("int4"))
    x = _x()
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
