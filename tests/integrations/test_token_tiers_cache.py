"""Token tiers through CertifiedCache (``StorageConfig(heavy_share=...)``): the prefill's attention picks each
(layer, KV head)'s heavy tokens, stored in the upgrade codecs instead of the light ones; every cell stays within its
certificate (validate mode, per cell), ``tau = 0`` serves the dense tokens, an ingested prefill with its recorded
attention picks the same tokens, the bytes are the stored tensors', and settings that cannot be served are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.eval.attention_record import recorded_attention
from kvcert.evict import SnapKV
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random
from kvcert.quant.token_tiers import TokenTiers

from ..cache.test_device_bytes import walk_device_bytes
from .test_device_budget import _stepwise

torch.set_num_threads(1)

TIERS = {"upgrade_keys": "dither-int8", "upgrade_values": "int4", "heavy_share": 0.25}


def _gate(tau: float) -> Gate:
    return Gate.certified(tau, granularity="block", block_size=8, persistent=True, box=True, tier_b=True)


def _ids(model, n=80, seed=7):
    return torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _storage(**kw):
    return StorageConfig(
        **{"keys": "dither-int4", "values": "int2", "write_block": 4, "device_budget": None} | TIERS | kw
    )


def _heavy(cache):
    """Per layer, the heavy masks of every chunk of the keys, in order."""
    return [[c.heavy for c in layer.store.k.chunks] for layer in cache.layers]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_every_cell_is_within_its_certificate_with_token_tiers(family):
    model = tiny_random(family, head_dim=32)
    cache = CertifiedCache(model, gate=_gate(0.005), seed=3, storage=_storage(), validate=True)
    _stepwise(model, _ids(model), cache, 16)
    cache.detach()
    tel = cache.telemetry()
    assert tel.heavy_entries > 0 and tel.summary()["heavy_entries"] == tel.heavy_entries
    assert tel.tiers["heavy_entries"].startswith("measured") and tel.tiers["upgraded_entries"].startswith("measured")
    assert tel.violations == 0 and tel.out_violations == 0 and tel.partial_violations == 0
    seen = ~torch.isnan(tel.true_tv)
    assert bool(seen.any()) and bool((tel.true_tv[seen] <= tel.certificates[seen]).all())  # per cell
    assert bool((tel.true_tv_served[seen] <= tel.served[seen] + 1e-15).all())
    assert tel.bytes_device == sum(walk_device_bytes(layer.store) for layer in cache.layers)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_the_value_gate_keeps_every_cell_within_its_output_bound(family):
    """The value gate (``value_rel``) over token tiers, teacher-forced beside the same cache without it: every cell's
    output bound still covers its true error (validate mode), and the gate repaired values the other did not."""
    model = tiny_random(family, head_dim=32)
    gates = {"off": _gate(0.005), "on": dataclasses.replace(_gate(0.005), value_rel=0.02)}
    tel = {}
    for name, gate in gates.items():
        cache = CertifiedCache(model, gate=gate, seed=3, storage=_storage(), validate=True)
        _stepwise(model, _ids(model), cache, 16)
        cache.detach()
        tel[name] = cache.telemetry()
    on = tel["on"]
    assert on.violations == 0 and on.out_violations == 0 and on.partial_violations == 0
    seen = ~torch.isnan(on.true_out_err)
    assert bool(seen.any()) and bool((on.true_out_err[seen] <= on.out_bound[seen]).all())  # per cell
    # it acted: upgraded values or paged exact ones in, and the largest value term fell
    off = tel["off"]
    assert on.upgraded_entries > off.upgraded_entries or on.bytes_paged > off.bytes_paged
    assert float(on.value_term.max()) < float(off.value_term.max())


HEAVY_VALUES = {"values": "minmax-int2", "upgrade_values": "minmax-int4", "heavy_values": "int8"}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_heavy_values_of_their_own_keep_every_cell_within_its_bounds(family):
    """Heavy values in their own codec and share (``heavy_values``, ``heavy_value_share``), under the value gate:
    every cell within its certificate and its output bound (validate mode, per cell)."""
    model = tiny_random(family, head_dim=32)
    gate = dataclasses.replace(_gate(0.005), value_rel=0.02)
    storage = _storage(**HEAVY_VALUES, heavy_value_share=0.15)
    cache = CertifiedCache(model, gate=gate, seed=3, storage=storage, validate=True)
    _stepwise(model, _ids(model, n=96), cache, 12)
    cache.detach()
    tel = cache.telemetry()
    assert tel.violations == 0 and tel.out_violations == 0 and tel.partial_violations == 0
    seen = ~torch.isnan(tel.true_tv)
    assert bool(seen.any()) and bool((tel.true_tv[seen] <= tel.certificates[seen]).all())
    seen = ~torch.isnan(tel.true_out_err)
    assert bool(seen.any()) and bool((tel.true_out_err[seen] <= tel.out_bound[seen]).all())
    assert tel.bytes_device == sum(walk_device_bytes(layer.store) for layer in cache.layers)


def test_heavy_values_are_the_top_of_the_same_ranking():
    model = tiny_random("llama", head_dim=32)
    ids = _ids(model, n=400)
    storage = _storage(**HEAVY_VALUES, heavy_share=0.3, heavy_value_share=0.1)
    cache = CertifiedCache(model, gate=_gate(0.005), seed=3, storage=storage)
    _stepwise(model, ids, cache, 2)
    cache.detach()
    for layer in cache.layers:
        keys, values = layer.store.k.chunks[0], layer.store.v.chunks[0]
        assert keys.heavy is not None and values.heavy is not None
        assert bool((keys.heavy.sum(-1) == 120).all()) and bool((values.heavy.sum(-1) == 40).all())
        assert not bool((values.heavy & ~keys.heavy).any())  # the heaviest of the heavy keys' tokens
        assert bool(values.heavy[..., -32:].all())  # the protected window first
        assert values.packed.tensors["heavy.codes"].dtype == torch.int8  # int8 codes, one byte each


def test_heavy_tokens_are_the_prefill_attentions_choice_at_the_share():
    model = tiny_random("llama", head_dim=32)
    ids = _ids(model, n=160)
    cache = CertifiedCache(model, gate=_gate(0.005), seed=3, storage=_storage(heavy_share=0.3))
    _stepwise(model, ids, cache, 2)
    cache.detach()
    for layer in cache.layers:
        first = layer.store.k.chunks[0]  # the prefill's whole blocks: [0, 160)
        assert first.heavy is not None and first.stop - first.start == 160
        assert bool((first.heavy.sum(-1) == 48).all())  # ⌈0.3·160⌉ on every (row, KV head)
        assert bool(first.heavy[..., -32:].all())  # the select policy's recent window (SnapKV, 32) first
        assert bool((first.heavy != first.heavy[:, :1]).any())  # the KV heads chose differently
    # the decode's own tokens are light
    assert all(c.heavy is None for layer in cache.layers for c in layer.store.k.chunks[1:])


def test_an_ingested_prefill_with_its_recorded_attention_chooses_the_same_tokens():
    model = tiny_random("qwen2", head_dim=32)
    ids = _ids(model, n=96)
    own = CertifiedCache(model, seed=3, storage=_storage())
    with torch.no_grad():
        model(ids, cache=own, use_cache=True)
        model(ids[:, -1:], cache=own, use_cache=True)  # encodes the prefill
    own.detach()
    pre = DynamicCache(config=model.config)
    with torch.no_grad(), recorded_attention(model, SnapKV(window=32, kernel=5).prefill_reads) as rec:
        model(ids, cache=pre, use_cache=True)
    ingested = CertifiedCache(model, seed=3, storage=_storage())
    ingested.ingest(pre, [rec[i] for i in range(len(pre.layers))])
    with torch.no_grad():
        model(ids[:, -1:], cache=ingested, use_cache=True)
    ingested.detach()
    for a, b in zip(_heavy(own), _heavy(ingested), strict=True):
        assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tau0_with_token_tiers_is_token_identical_to_dynamic_cache(family):
    model = tiny_random(family, head_dim=32)
    ids = _ids(model, n=48, seed=0)
    ref = _stepwise(model, ids, DynamicCache(config=model.config), 12)
    cache = CertifiedCache(model, gate=_gate(0.0), seed=1, storage=_storage())
    got = _stepwise(model, ids, cache, 12)
    cache.detach()
    assert torch.equal(ref, got) and cache.telemetry().heavy_entries > 0


def test_token_tier_settings_that_cannot_be_served_are_refused():
    model = tiny_random("llama", head_dim=32)
    with pytest.raises(ValueError, match="give upgrade_keys"):
        StorageConfig(keys="int4", values="int4", heavy_share=0.2)
    for share in (0.0, 1.0, -0.1, True, "0.2"):
        with pytest.raises(ValueError, match="heavy_share must be a fraction"):
            _storage(heavy_share=share)
    with pytest.raises(ValueError, match="give heavy_share too"):
        StorageConfig(heavy_select=SnapKV())
    with pytest.raises(TypeError, match="heavy_select must be"):
        _storage(heavy_select="snapkv")
    for name, value in (("heavy_values", "int8"), ("heavy_value_share", 0.1)):
        with pytest.raises(ValueError, match=f"{name} is a setting of token tiers: give heavy_share too"):
            StorageConfig(**{name: value})
    with pytest.raises(ValueError, match="heavy_value_share: heavy_share must be a fraction"):
        _storage(heavy_value_share=1.5)
    with pytest.raises(TypeError, match="heavy_values must be"):
        _storage(heavy_values=8)
    with pytest.raises(ValueError, match="residual window"):
        StorageConfig(**TIERS, heavy_values="kivi-2", seed=1).store(0)
    with pytest.raises(ValueError, match="upgrade"):  # eviction refuses the upgrade codecs the tiers live in
        CertifiedCache(model, storage=_storage(), eviction=EvictionConfig.prefill(SnapKV(), 0.5))


def _dropped_are_the_upgraded(store) -> bool:
    """Every entry whose light codes a chunk dropped is one a live upgrade record holds, and the reverse."""
    for ts in (store.k, store.v):
        dropped = torch.cat([TokenTiers.dropped_mask(c.packed) for c in ts.chunks], -1)
        held = torch.zeros_like(dropped)
        for u in ts.upgrades:
            held[u.b, u.h, u.slots - ts.chunks[0].start] = True
        if not torch.equal(dropped, held):
            return False
    return True


def test_a_binding_budget_gives_dropped_codes_back_and_every_cell_stays_certified():
    model = tiny_random("llama", head_dim=32)
    cache = CertifiedCache(model, gate=_gate(0.005), seed=3, storage=_storage(device_budget=0.41), validate=True)
    _stepwise(model, _ids(model), cache, 16)
    cache.detach()
    tel = cache.telemetry()
    assert tel.upgraded_entries > 0 and tel.released_entries > 0  # upgrades kept, some given back
    assert tel.violations == 0 and tel.out_violations == 0 and tel.partial_violations == 0
    seen = ~torch.isnan(tel.true_tv)
    assert bool((tel.true_tv_served[seen] <= tel.served[seen] + 1e-15).all())  # per cell, after the releases
    assert all(_dropped_are_the_upgraded(layer.store) for layer in cache.layers)
    assert all(bool(torch.isfinite(layer.store.k.served.view()).all()) for layer in cache.layers)
    assert tel.bytes_device == sum(walk_device_bytes(layer.store) for layer in cache.layers)
    assert tel.bytes_device <= 0.45 * tel.bytes_fp16
