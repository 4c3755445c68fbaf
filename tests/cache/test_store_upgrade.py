"""Upgrade repair in the store (``LayerStore(upgrade=(key codec, value codec))``): a persistent repair re-encodes the
repaired entries in the wider codecs, serves their decode, stores witnesses that bound the new residual, counts the
new codes' measured bytes against the device budget, and gives them back (first codes and witnesses restored) when
the budget binds."""

from __future__ import annotations

import pytest
import torch

from kvcert.bounds import band_norms
from kvcert.cache.store import UPGRADE_STREAM, LayerStore
from kvcert.quant import DitherKey, get
from kvcert.quant.per_head import PerHeadCodec

from .test_cache_store import _assert_norm_witnesses, _kv, _rows

WITNESSES = ("k_band", "k_wit", "k_hat_norm", "v_res", "v_hat_norm", "v_dist", "k_steps")


def _store(keys="dither-int4", values="int2", up=("dither-int8", "int4"), **kw):
    return LayerStore(
        0, get(keys), get(values), bands=8, pairing="rotate_half", seed=1, upgrade=(get(up[0]), get(up[1])), **kw
    )


def _filled(st, t=32):
    k, v = _kv(t=t)
    st.append(k, v, *_rows())
    st.append(*_kv(t=1, seed=9), *_rows())  # encodes the first t tokens; one pending (exact) token
    return k, v


def _state(st):
    return {name: getattr(st, name).view().clone() for name in WITNESSES} | {
        "k": st.k.served.view().clone(),
        "v": st.v.served.view().clone(),
    }


def test_upgrade_serves_the_upgrade_codes_and_witnesses_bound_the_new_residual():
    st = _store()
    k, _ = _filled(st)
    before, old = st.bytes_device(), _state(st)
    assert st.persist(1, 2, slice(4, 12))
    x = st.k.host.view()[1:2, :, 4:12]
    key = DitherKey(1 ^ UPGRADE_STREAM, torch.tensor([1]), 0, torch.arange(4, 12)[None])
    codec = get("dither-int8")
    packed = codec.encode(x, key)
    assert torch.equal(st.k.served.view()[1, 2, 4:12], codec.decode(packed, key)[0, 2])
    assert torch.equal(st.k_steps.view()[1, 2, 4:12], codec.steps(packed)[0, 2])  # Tier B reads the new steps
    assert torch.equal(
        st.v.served.view()[1, 2, 4:12], get("int4").decode(get("int4").encode(st.v.host.view()[1:2, :, 4:12]))[0, 2]
    )
    touched = torch.zeros(2, 3, 33, dtype=torch.bool)
    touched[1, 2, 4:12] = True
    assert torch.equal(st.k.served.view()[~touched], old["k"][~touched])  # nothing else moves
    assert torch.equal(st.v.served.view()[~touched], old["v"][~touched])
    resid = st.k.served.view()[1, 2, 4:12].double() - k[1, 2, 4:12].double()
    assert torch.all(st.k_band.view()[1, 2, 4:12].double() >= band_norms(resid, 8, "rotate_half"))
    assert resid.norm(dim=-1).max() < (old["k"][1, 2, 4:12].double() - k[1, 2, 4:12].double()).norm(dim=-1).min()
    dv = st.v.served.view()[1, 2, 4:12].double() - st.v.host.view()[1, 2, 4:12].double()
    assert torch.all(st.v_res.view()[1, 2, 4:12].double() >= dv.norm(dim=-1))
    _assert_norm_witnesses(st)
    records = st.k.upgrades + st.v.upgrades
    assert st.bytes_device() - before == sum(u.packed.nbytes for u in records) > 0  # the new codes, measured
    assert st.upgraded == 16 and st.n_held == 0 and not st.k.exact.view()[1, 2, 4:12].any()


def test_upgrade_leaves_exact_and_upgraded_entries_as_they_are():
    st = _store()
    _filled(st)
    assert st.persist(0, 1, slice(30, 33))  # slot 32 is pending (exact): not re-encoded
    assert st.upgraded == 4 and torch.equal(st.k.upgrades[0].slots, torch.tensor([30, 31]))
    assert torch.equal(st.k.served.view()[0, 1, 32], st.k.host.view()[0, 1, 32])
    bytes_once, state = st.bytes_device(), _state(st)
    assert st.persist(0, 1, torch.tensor([False] * 30 + [True] * 3))  # the same entries again: nothing to do
    assert st.bytes_device() == bytes_once and st.upgraded == 4
    assert all(torch.equal(state[name], now) for name, now in _state(st).items())


def test_a_refused_upgrade_changes_nothing_and_is_counted():
    st = _store(device_budget=1.0)
    _filled(st)
    st.device_budget = st.bytes_device() / st.bytes_fp16()  # full: no room for the new codes
    state = _state(st)
    assert not st.persist(0, 0, slice(0, 16))
    # its traffic is what a host-side encoder would send: per entry the new codes (dither-int8 key: 64 codes and two
    # fp16 scales; int4 value: 32 bytes of codes and two scales) and the 9 bytes of log8 witnesses (8 bands, 1 v_res)
    assert st.transient_repairs == 1 and st.bytes_transient == 16 * ((64 + 4) + (32 + 4) + 9)
    assert st.upgraded == 0 and not st.k.upgrades and not st.v.upgrades
    assert all(torch.equal(state[name], now) for name, now in _state(st).items())


def test_the_budget_releases_upgrades_newest_first_back_to_their_first_codes_and_witnesses():
    st = _store()
    _filled(st)
    state = _state(st)
    assert st.persist(0, 1, slice(0, 16)) and st.persist(1, 0, slice(8, 24))
    upgraded = _state(st)
    st.device_budget = st.bytes_device() / st.bytes_fp16()  # full: the next write takes more than it frees
    st.append(*_kv(t=2, seed=11), *_rows())
    assert st.bytes_device() <= st.device_budget * st.bytes_fp16()
    kept = [(u.b, u.order) for u in st.k.upgrades + st.v.upgrades]
    assert st.released > 0 and len(kept) < 4 and sorted(o for _, o in kept) == list(range(len(kept)))  # the oldest
    for ts, name in ((st.k, "k"), (st.v, "v")):
        for b, h in ((0, 1), (1, 0)):
            held = any(u.b == b for u in ts.upgrades)
            want = upgraded if held else state
            assert torch.equal(getattr(st, name).served.view()[b, h, :32], want[name][b, h, :32])
    if not st.k.upgrades:  # every key record released: the key witnesses are the first ones again
        for name in ("k_band", "k_hat_norm", "k_steps"):
            assert torch.equal(getattr(st, name).view()[:, :, :32], state[name][:, :, :32]), name
    _assert_norm_witnesses(st)


def test_a_sliding_trim_keeps_the_upgraded_entries_it_keeps_and_their_bytes_only():
    st = _store()
    _filled(st)
    assert st.persist(0, 1, slice(4, 12))
    served = st.k.served.view()[0, 1, 8:12].clone()
    per_entry = st.k.upgrades[0].packed.nbytes // 8
    st.drop_before(8)
    assert torch.equal(st.k.upgrades[0].slots, torch.arange(8, 12)) and st.k.upgrades[0].packed.nbytes == 4 * per_entry
    assert torch.equal(st.k.served.view()[0, 1, 0:4], served)
    st.drop_before(4)
    assert not st.k.upgrades and not st.v.upgrades and st.k.packed_nbytes() == sum(c.packed.nbytes for c in st.k.chunks)


def test_eviction_is_refused_and_emptied_keeps_the_upgrade_codecs():
    st = _store()
    _filled(st)
    with pytest.raises(ValueError, match="upgrade"):
        st.gather(torch.tensor([0, 3]).expand(2, 3, 2).contiguous())
    assert st.emptied().upgrade == st.upgrade


@pytest.mark.parametrize(
    ("keys", "up", "match"),
    [
        ("dither-int4", ("int8", "int4"), "Tier-B"),  # the Tier-B radii need the upgrade codec's steps
        ("dither-int4+bypass2", ("dither-int8", "int4"), "bypassed channels"),
        ("int4", ("kivi-2", "int4"), "block 1"),
        ("int4", ("int8", "mixed"), "per-head"),
    ],
)
def test_upgrade_codecs_that_cannot_serve_are_refused_by_name(keys, up, match):
    value_up = PerHeadCodec(["int8", "int4", "int8"]) if up[1] == "mixed" else get(up[1])
    with pytest.raises(ValueError, match=match):
        LayerStore(0, get(keys), get("int2"), bands=8, pairing="rotate_half", seed=1, upgrade=(get(up[0]), value_up))
    with pytest.raises(ValueError, match="pair"):
        LayerStore(0, get(keys), get("int2"), bands=8, pairing="rotate_half", seed=1, upgrade=("int8", "int4"))


def test_an_upgraded_token_keeps_the_channels_the_key_codec_bypasses():
    """The Tier-B radius masks the query with the key codec's bypassed channels, so upgraded keys keep exactly those
    channels exact (the upgrade codec takes them over instead of choosing its own from the tokens it re-encodes)."""
    st = _store("dither-int4+bypass2", up=("dither-int8+bypass2", "int4"))
    k, _ = _filled(st)
    assert st.persist(0, 2, slice(0, 8))
    channels = st.key_codec.channels[2]
    assert torch.equal(st.upgrade[0].channel_mask, st.key_codec.channel_mask)
    assert torch.equal(st.k.served.view()[0, 2, :8][:, channels], k[0, 2, :8][:, channels].half().float())  # fp16
    _assert_norm_witnesses(st)
