import pytest
import torch
from quant_cases import with_outlier_channels

from kvcert.bounds.rope import pair_sq_moduli
from kvcert.quant import OutlierBypass, bytes_per_token_head, get, quantize, sample_key
from kvcert.quant.dither import DitherCodec


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_bypassed_pairs_are_the_top_energy_pairs_and_exact(pairing):
    channels = (3, 35) if pairing == "rotate_half" else (6, 7)  # pair 3 in either convention
    x = with_outlier_channels(channels=channels)
    codec = get("int8", bypass=2, pairing=pairing)
    q = quantize(codec, x, pairing=pairing)
    assert isinstance(codec, OutlierBypass) and codec.name == "int8+bypass2"
    energy = pair_sq_moduli(x, pairing).sum(dim=(0, 2))
    top = energy.topk(2, dim=-1).indices
    assert bool((top == 3).any(dim=-1).all())
    mask = codec.channel_mask
    assert mask is not None and mask.shape == (2, 64)
    assert bool((mask[:, list(channels)] == 0).all()) and int((mask == 0).sum()) == 2 * 2 * 2
    bypassed = (mask == 0).view(1, 2, 1, 64).expand_as(x)
    delta = q.x_hat - x
    assert bool((delta[bypassed] == 0).all())
    assert bool((delta[~bypassed] != 0).any())


def test_bypass_excludes_outliers_from_amax():
    x = with_outlier_channels()
    plain = get("int8").encode(x).tensors["scales"].to(torch.float32)
    codec = get("int8", bypass=1)
    wrapped = codec.encode(x).tensors["inner.scales"].to(torch.float32)
    # the inner scales are exactly those of x with the bypassed pair zeroed, never above the plain ones
    zeroed = x.clone()
    zeroed[..., [3, 35]] = 0.0
    assert torch.equal(wrapped, get("int8").encode(zeroed).tensors["scales"].to(torch.float32))
    assert bool((wrapped <= plain).all())
    # both groups held an outlier channel (3 and 35); excluding it shrinks the scales a lot
    assert float(wrapped.mean()) < 0.25 * float(plain.mean())
    base_err = (quantize(get("int8"), x).residual_norms).max()
    bypass_err = (quantize(get("int8", bypass=1), x).residual_norms).max()
    assert bypass_err < 0.25 * base_err


def test_bypass_calibrated_once_then_fixed():
    codec = get("int4", bypass=1)
    codec.encode(with_outlier_channels(channels=(3, 35)))
    first = codec.channels.clone()
    codec.encode(with_outlier_channels(channels=(10, 42), seed=1))
    assert torch.equal(codec.channels, first)
    with pytest.raises(ValueError, match="calibrated"):
        codec.encode(with_outlier_channels(h=3))


def test_bypass_bytes_add_four_bytes_per_pair():
    x = with_outlier_channels()
    plain = get("int8").encode(x).nbytes
    for m in (1, 4):
        assert get("int8", bypass=m).encode(x).nbytes == plain + 2 * 2 * 64 * 4 * m


def test_bypass_with_dither_passes_key_and_steps():
    x = with_outlier_channels()
    key = sample_key(x, seed=4)
    codec = get("dither-int8", bypass=2)
    q = quantize(codec, x, key=key)
    assert codec.tier_b and codec.needs_key
    assert q.steps is not None and q.steps.shape == (2, 2, 64, 2)
    assert torch.equal(q.x_hat, codec.decode(q.packed, key))


def test_bypass_validates_m_and_decode_before_calibration():
    with pytest.raises(ValueError, match="bypass"):
        get("int8", bypass=-1)
    with pytest.raises(ValueError, match="rotary pairs"):
        get("int8", bypass=40).encode(with_outlier_channels())
    fresh = get("int8", bypass=2)
    packed = get("int8", bypass=2)
    other = packed.encode(with_outlier_channels())
    with pytest.raises(ValueError, match="calibrated"):
        fresh.decode(other)


def test_bytes_per_token_head_leaves_calibration_untouched():
    codec = get("int8", bypass=2)
    assert bytes_per_token_head(codec, D=64) == 68 + 8
    assert codec.channels is None
    codec.encode(with_outlier_channels())
    assert bool((codec.channel_mask[:, [3, 35]] == 0).all())


def test_the_bypass_suffix_names_the_same_codec_as_the_option():
    """``get("dither-int8+bypass2")`` is ``get("dither-int8", bypass=2)``: the name an OutlierBypass gives itself
    resolves back to it (what ``--schemes`` lists); a malformed or doubled suffix is refused by name."""
    x = with_outlier_channels()
    key = sample_key(x, seed=4)
    by_name, by_option = get("dither-int8+bypass2"), get("dither-int8", bypass=2)
    assert isinstance(by_name, OutlierBypass) and by_name.name == by_option.name == "dither-int8+bypass2"
    a, b = by_name.encode(x, key), by_option.encode(x, key)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in b.tensors) and set(a.tensors) == set(b.tensors)
    assert get("kivi-2+bypass1", axis="value").inner.name == "kivi-2"
    for bad in ("int8+bypass0", "int8+bypassx", "+bypass2", "int8+bypass-1"):
        with pytest.raises(ValueError, match="positive integer"):
            get(bad)
    with pytest.raises(ValueError, match="bypass given twice"):
        get("int8+bypass2", bypass=3)
    with pytest.raises(ValueError, match="unknown codec 'int9'"):
        get("int9+bypass2")


def test_bypass_over_a_per_head_codec_keeps_its_heads():
    """Around ``dither-mixed`` the bypass keeps which heads each inner tensor holds (an eviction gather needs it) and
    decodes, per head, what the inner codec gives the masked keys plus the exact bypassed channels."""
    x = with_outlier_channels(2, 3, 16, 64, seed=2)
    key = sample_key(x, seed=1)
    codec = OutlierBypass(DitherCodec(head_bits=(8, 3, 5)), 2)
    packed = codec.encode(x, key)
    assert codec.heads == 3
    assert packed.heads == {"inner.codes8": (0,), "inner.codes5": (2,), "inner.codes3": (1,)}
    decoded = codec.decode(packed, key)
    idx = codec.channels.view(1, 3, 1, -1).expand(2, 3, 16, -1)
    assert torch.equal(decoded.gather(-1, idx), x.gather(-1, idx))  # fp16-exact input: bypassed channels exact
    masked = x * codec.channel_mask.view(1, 3, 1, 64)
    inner = DitherCodec(head_bits=(8, 3, 5))
    want = inner.decode(inner.encode(masked, key), key).scatter(-1, idx, x.gather(-1, idx))
    assert torch.equal(decoded, want)
