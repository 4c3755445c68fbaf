"""Token tiers in the store (``LayerStore(upgrade=..., token_tiers=True)``): the entries ``choose_heavy`` names are
stored in the upgrade codecs instead of the light ones, served as those codes decode, with witnesses of those codes;
the bytes are the stored tensors'; upgrade repairs leave them alone; bad choices are refused by name."""

from __future__ import annotations

import pytest
import torch

from kvcert.bounds import band_norms
from kvcert.cache.store import LayerStore
from kvcert.quant import DitherKey, get
from kvcert.quant.token_tiers import TokenTiers

from .test_cache_store import _assert_norm_witnesses, _kv, _rows


def _store(keys="dither-int4", values="int2", up=("dither-int8", "int4"), **kw):
    return LayerStore(
        0,
        get(keys),
        get(values),
        bands=8,
        pairing="rotate_half",
        seed=1,
        upgrade=(get(up[0]), get(up[1])),
        token_tiers=True,
        **kw,
    )


def _chosen(t=32, c=6):
    """Slots ``[2, 3, c]``: a different set per (row, KV head), the same count."""
    g = torch.Generator().manual_seed(2)
    return torch.stack(
        [torch.stack([torch.randperm(t, generator=g)[:c].sort().values for _ in range(3)]) for _ in range(2)]
    )


def _filled(st, slots, t=32):
    k, v = _kv(t=t)
    st.append(k, v, *_rows())
    st.choose_heavy(slots)
    st.append(*_kv(t=1, seed=9), *_rows())  # encodes the first t tokens; one pending (exact) token
    return k, v


def test_chosen_entries_are_served_from_the_upgrade_codes_and_witnessed_as_such():
    st = _store()
    slots = _chosen()
    k, v = _filled(st, slots)
    heavy = torch.zeros(2, 3, 32, dtype=torch.bool).scatter(2, slots, True)
    key = DitherKey(1, torch.arange(2), 0, torch.arange(32).expand(2, 32).contiguous())
    light, wide = get("dither-int4"), get("dither-int8")
    want_k = torch.where(
        heavy.unsqueeze(-1), wide.decode(wide.encode(k, key), key), light.decode(light.encode(k, key), key)
    )
    want_v = torch.where(
        heavy.unsqueeze(-1), get("int4").decode(get("int4").encode(v)), get("int2").decode(get("int2").encode(v))
    )
    assert torch.equal(st.k.served.view()[:, :, :32], want_k) and torch.equal(st.v.served.view()[:, :, :32], want_v)
    steps = torch.where(heavy.unsqueeze(-1), wide.steps(wide.encode(k, key)), light.steps(light.encode(k, key)))
    assert torch.equal(st.k_steps.view()[:, :, :32], steps)  # Tier B reads each token's own steps
    resid = st.k.served.view()[:, :, :32].double() - k.double()
    assert torch.all(st.k_band.view()[:, :, :32].double() >= band_norms(resid, 8, "rotate_half"))
    dv = st.v.served.view()[:, :, :32].double() - v.double()
    assert torch.all(st.v_res.view()[:, :, :32].double() >= dv.norm(dim=-1))
    _assert_norm_witnesses(st)
    for b in range(2):
        for h in range(3):
            assert torch.equal(st.k.wide(b, h, 33, st.base)[:32], heavy[b, h])
    assert st.heavy_entries == 2 * 2 * 3 * 6  # K and V apart


def test_the_bytes_are_the_stored_tensors_and_each_token_is_stored_once():
    tiered, light = _store(), LayerStore(0, get("dither-int4"), get("int2"), bands=8, pairing="rotate_half", seed=1)
    _filled(tiered, _chosen())
    k, v = _kv(t=32)
    light.append(k, v, *_rows())
    light.append(*_kv(t=1, seed=9), *_rows())
    packed = sum(c.packed.nbytes for ts in (tiered.k, tiered.v) for c in ts.chunks)
    assert packed == sum(
        t.numel() * t.element_size()
        for ts in (tiered.k, tiered.v)
        for c in ts.chunks
        for t in c.packed.tensors.values()
    )
    assert tiered.bytes_device() - light.bytes_device() == packed - sum(
        c.packed.nbytes for ts in (light.k, light.v) for c in ts.chunks
    )
    # 6 of 32 tokens per head wider: int8 keys over int4 (+32 B), int4 values over int2 (+16 B), and the bit masks
    assert (
        packed - sum(c.packed.nbytes for ts in (light.k, light.v) for c in ts.chunks)
        == 2 * 3 * 6 * (32 + 16) + 2 * 2 * 3 * 4
    )
    assert isinstance(tiered.k.codec, TokenTiers) and tiered.key_codec.name == "dither-int4"


def test_upgrade_repairs_leave_heavy_entries_alone():
    st = _store()
    slots = _chosen()
    _filled(st, slots)
    assert st.persist(0, 1, slice(0, 32))
    light_count = 32 - 6
    assert st.upgraded == 2 * light_count  # only the light entries of (0, 1), K and V
    assert bool(st.k.wide(0, 1, 33, st.base)[:32].all())


def test_entries_encoded_after_the_choice_are_light_and_a_trim_keeps_the_tiers_aligned():
    st = _store(write_block=8)
    k, v = _kv(t=30)
    st.append(k, v, *_rows())
    slots = torch.arange(22, 30).expand(2, 3, 8).contiguous()  # the newest 8: the 6 still pending stay chosen
    st.choose_heavy(slots)
    st.append(*_kv(t=10, seed=3), *_rows())  # encodes [0, 24): 2 chosen per head, the rest light
    st.append(*_kv(t=1, seed=4), *_rows())  # encodes [24, 40): the 6 chosen pending ones, then new tokens
    assert st.heavy_entries == 2 * 2 * 3 * 8
    st.drop_before(20)
    assert torch.equal(st.k.wide(0, 0, st.n, st.base)[:10], torch.tensor([False] * 2 + [True] * 8))
    assert not st.k.wide(1, 2, st.n, st.base)[10:].any()


def test_bad_choices_are_refused_by_name():
    with pytest.raises(ValueError, match="give upgrade= too"):
        LayerStore(0, get("int4"), get("int4"), bands=8, pairing="rotate_half", seed=0, token_tiers=True)
    plain = LayerStore(0, get("int4"), get("int4"), bands=8, pairing="rotate_half", seed=0)
    plain.append(*_kv(t=4), *_rows())
    with pytest.raises(ValueError, match="token-tier store"):
        plain.choose_heavy(torch.zeros(2, 3, 1, dtype=torch.int64))
    st = _store()
    st.append(*_kv(t=8), *_rows())
    with pytest.raises(ValueError, match=r"\[B, H, C\]"):
        st.choose_heavy(torch.zeros(3, 3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="live slots"):
        st.choose_heavy(torch.full((2, 3, 1), 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="repeat a slot"):
        st.choose_heavy(torch.zeros(2, 3, 2, dtype=torch.int64))


def test_a_write_stores_each_heads_own_chosen_count():
    st = _store(write_block=8)
    st.append(*_kv(t=12), *_rows())
    slots = torch.tensor([3, 9]).expand(2, 3, 2).clone()
    slots[1, 2] = torch.tensor([3, 4])  # (1, 2) has both in [0, 8), every other head one in each block
    st.choose_heavy(slots)
    st.append(*_kv(t=1, seed=3), *_rows())  # encodes [0, 8) only
    want = torch.zeros(2, 3, 8, dtype=torch.bool)
    want[:, :, 3] = True
    want[1, 2, 4] = True
    assert torch.equal(st.k.chunks[0].heavy, want) and torch.equal(TokenTiers.heavy_mask(st.v.chunks[0].packed), want)
    assert st.heavy_entries == 2 * 7


def _light_codes(st, ts):
    """``[B, H, S]`` bool: the entries whose light codes a chunk of ``ts`` still holds."""
    return torch.cat([~TokenTiers.heavy_mask(c.packed) & ~TokenTiers.dropped_mask(c.packed) for c in ts.chunks], -1)


def test_an_upgrade_drops_the_light_codes_it_replaces_and_counts_the_net_bytes():
    st = _store()
    slots = _chosen()
    _filled(st, slots)
    served = st.k.served.view().clone()
    before, light_before = st.bytes_device(), _light_codes(st, st.k)
    assert st.persist(0, 1, slice(0, 20))
    upgraded = torch.zeros(2, 3, 32, dtype=torch.bool)
    upgraded[0, 1, :20] = light_before[0, 1, :20]
    for ts in (st.k, st.v):
        assert torch.equal(_light_codes(st, ts), light_before & ~upgraded)  # dropped where upgraded, nowhere else
        assert torch.equal(TokenTiers.dropped_mask(ts.chunks[0].packed), upgraded)
        decoded = ts.codec.decode(ts.chunks[0].packed, ts.chunks[0].key)
        assert bool(decoded[upgraded].isnan().all())  # fail closed: a dropped entry is never served from the chunk
    others = ~torch.nn.functional.pad(upgraded, (0, 1))  # the pending slot 32 included
    assert torch.equal(st.k.served.view()[others], served[others])
    n = int(upgraded.sum())
    # per entry: the new codes (dither-int8 64 + 4, int4 32 + 4) in, the light ones (dither-int4 32 + 4, int2 16 + 4)
    # out; plus the dropped-entry bit masks (4 bytes per (row, head) for 32 slots, K and V)
    assert st.bytes_device() - before == n * ((68 + 36) - (36 + 20)) + 2 * (2 * 3 * 4)
    assert st.bytes_device() == sum(c.packed.nbytes for ts in (st.k, st.v) for c in ts.chunks + ts.upgrades) + (
        st.bytes_witness() + st.k.exact_nbytes(64) + st.v.exact_nbytes(64)
    )
    parts = st.device_bytes_by_part()
    assert sum(parts.values()) == st.bytes_device()
    light, heavy = int((light_before & ~upgraded).sum()), int(TokenTiers.heavy_mask(st.k.chunks[0].packed).sum())
    assert parts["k light codes"] == light * (32 + 4) and parts["v light codes"] == light * (16 + 4)
    assert parts["k heavy codes"] == heavy * (64 + 4) and parts["k upgrade codes"] == n * (64 + 4)
    assert parts["k tier masks"] == 2 * (2 * 3 * 4)  # the choice and the dropped entries, 4 bytes per (row, head)


def test_a_value_upgrade_drops_the_light_value_codes_only_and_sends_the_value_witness_only():
    st = _store()
    _filled(st, _chosen())
    keys, k_light, v_light = st.k.served.view().clone(), _light_codes(st, st.k), _light_codes(st, st.v)
    assert torch.equal(st.light(0, 1, is_key=False)[:32], v_light[0, 1])
    before = st.bytes_device()
    plan = st.plan_upgrade(0, 1, slice(0, 20), keys=False)
    (part,) = plan.parts
    assert not part.is_key and torch.equal(part.slots, v_light[0, 1, :20].nonzero().view(-1))
    n = len(part.slots)
    assert plan.witness_bytes == 1 and plan.nbytes == n * (32 + 4) + n  # int4 codes and scales, one log8 code each
    assert st.commit_upgrade(plan)
    assert torch.equal(_light_codes(st, st.k), k_light) and torch.equal(st.k.served.view(), keys)  # keys untouched
    upgraded = torch.zeros_like(v_light)
    upgraded[0, 1, part.slots] = True
    assert torch.equal(_light_codes(st, st.v), v_light & ~upgraded)
    assert not bool(st.light(0, 1, is_key=False)[part.slots].any()) and bool(
        st.light(0, 1, is_key=True)[part.slots].all()
    )
    assert st.bytes_device() - before == n * (36 - 20) + 2 * 3 * 4  # int4 over int2 values; the dropped-entry mask
    _assert_norm_witnesses(st)
    # a later key upgrade of the same entries re-encodes the keys only
    (kpart,) = st.plan_upgrade(0, 1, slice(0, 20)).parts
    assert kpart.is_key and torch.equal(kpart.slots, part.slots)


def test_the_budget_gives_the_dropped_light_codes_back_bit_for_bit():
    st = _store()
    slots = _chosen()
    _filled(st, slots)
    chunks = {name: dict(ts.chunks[0].packed.tensors) for name, ts in (("k", st.k), ("v", st.v))}  # never mutated
    served = (st.k.served.view().clone(), st.v.served.view().clone())
    first = st.bytes_device()
    assert st.persist(0, 1, slice(0, 16)) and st.persist(1, 0, slice(8, 24))
    st.device_budget = first / st.bytes_fp16()  # below what the upgrades hold: every record is released
    st.append(*_kv(t=1, seed=11), *_rows())
    assert not st.k.upgrades and not st.v.upgrades and st.released > 0
    for name, ts in (("k", st.k), ("v", st.v)):
        now = ts.chunks[0].packed.tensors
        assert now.keys() == chunks[name].keys() and all(torch.equal(now[n], chunks[name][n]) for n in now)
    assert torch.equal(st.k.served.view()[:, :, :32], served[0][:, :, :32])
    assert torch.equal(st.v.served.view()[:, :, :32], served[1][:, :, :32])
    _assert_norm_witnesses(st)


def test_heavy_values_take_their_own_codec_and_slots():
    """``heavy_values=`` and ``choose_heavy(slots, value_slots)``: the heavy keys are ``slots`` in the upgrade key
    codec, the heavy values ``value_slots`` in their own codec, every other value light; each value witnessed as
    served; a value upgrade re-encodes the light values only, the heavy keys' tokens' among them, in the upgrade
    value codec; the bytes are the stored tensors'."""
    st = _store(heavy_values=get("int8"))
    slots = _chosen()
    value_slots = slots[:, :, :2].contiguous()
    k, v = _kv(t=32)
    st.append(k, v, *_rows())
    st.choose_heavy(slots, value_slots)
    st.append(*_kv(t=1, seed=9), *_rows())
    heavy_k = torch.zeros(2, 3, 32, dtype=torch.bool).scatter(2, slots, True)
    heavy_v = torch.zeros(2, 3, 32, dtype=torch.bool).scatter(2, value_slots, True)
    want_v = torch.where(
        heavy_v.unsqueeze(-1), get("int8").decode(get("int8").encode(v)), get("int2").decode(get("int2").encode(v))
    )
    assert torch.equal(st.v.served.view()[:, :, :32], want_v)
    dv = st.v.served.view()[:, :, :32].double() - v.double()
    assert torch.all(st.v_res.view()[:, :, :32].double() >= dv.norm(dim=-1))
    _assert_norm_witnesses(st)
    for b in range(2):
        for h in range(3):
            assert torch.equal(st.k.wide(b, h, 33, st.base)[:32], heavy_k[b, h])
            assert torch.equal(st.v.wide(b, h, 33, st.base)[:32], heavy_v[b, h])
    assert st.heavy_entries == 2 * 3 * (6 + 2)
    plan = st.plan_upgrade(0, 1, slice(0, 32), keys=False)
    (part,) = plan.parts
    assert torch.equal(part.slots, (~heavy_v[0, 1]).nonzero().view(-1))  # the heavy keys' light values included
    assert part.packed.codec == "int4"
    assert st.emptied().heavy_values is st.heavy_values
    # 6 keys of 32 per head in int8 over dither-int4 (+32 B), 2 values in int8 over int2 (+48 B), and the bit masks
    light = LayerStore(0, get("dither-int4"), get("int2"), bands=8, pairing="rotate_half", seed=1)
    light.append(k, v, *_rows())
    light.append(*_kv(t=1, seed=9), *_rows())
    extra = sum(c.packed.nbytes for ts in (st.k, st.v) for c in ts.chunks) - sum(
        c.packed.nbytes for ts in (light.k, light.v) for c in ts.chunks
    )
    assert extra == 2 * 3 * (6 * 32 + 2 * 48) + 2 * 2 * 3 * 4


def test_heavy_values_without_value_slots_follow_the_keys_and_bad_ones_are_refused():
    st = _store(heavy_values=get("int8"))
    slots = _chosen()
    _, v = _filled(st, slots)
    heavy = torch.zeros(2, 3, 32, dtype=torch.bool).scatter(2, slots, True)
    want_v = torch.where(
        heavy.unsqueeze(-1), get("int8").decode(get("int8").encode(v)), get("int2").decode(get("int2").encode(v))
    )
    assert torch.equal(st.v.served.view()[:, :, :32], want_v)
    with pytest.raises(ValueError, match="token_tiers=True"):
        LayerStore(0, get("int4"), get("int4"), bands=8, pairing="rotate_half", seed=0, heavy_values=get("int8"))
    with pytest.raises(ValueError, match="residual window"):
        _store(heavy_values=get("kivi-2"))
    st = _store()
    st.append(*_kv(t=8), *_rows())
    with pytest.raises(ValueError, match="value_slots repeat a slot"):
        st.choose_heavy(torch.zeros(2, 3, 1, dtype=torch.int64), torch.zeros(2, 3, 2, dtype=torch.int64))
