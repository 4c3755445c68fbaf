"""Upgrade repair through CertifiedCache (``StorageConfig(upgrade_keys=..., upgrade_values=...)``): persistent repairs
re-encode in wider codecs; every cell stays within its certificate (validate mode, per cell), ``tau = 0`` still
serves the dense tokens, the device budget holds at every step, and the bytes are the stored tensors'."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.evict import SnapKV
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

from ..cache.test_device_bytes import walk_device_bytes
from .test_device_budget import _ingested, _stepwise

torch.set_num_threads(1)

UPGRADE = {"upgrade_keys": "dither-int8", "upgrade_values": "int4"}


def _gate(tau: float) -> Gate:
    return Gate.certified(tau, granularity="block", block_size=8, persistent=True, box=True, tier_b=True)


def _validated(family: str, steps: int = 16):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(7))
    storage = StorageConfig(keys="dither-int4", values="int2", write_block=4, device_budget=None, **UPGRADE)
    cache = CertifiedCache(model, gate=_gate(0.005), seed=3, storage=storage, validate=True)
    _stepwise(model, ids, cache, steps)
    cache.detach()
    return cache


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_every_cell_is_within_its_certificate_with_upgrade_repairs(family):
    cache = _validated(family)
    tel = cache.telemetry()
    assert tel.upgraded_entries > 0  # the repairs did re-encode
    assert tel.violations == 0 and tel.out_violations == 0 and tel.partial_violations == 0
    seen = ~torch.isnan(tel.true_tv)
    assert bool(seen.any()) and bool((tel.true_tv[seen] <= tel.certificates[seen]).all())  # per cell, before repair
    # ... and of what was served, after it (a read served exact has certificate 0 and a measured TV of float64
    # rounding, ~1e-17: the TV of two softmaxes of the same logits computed apart)
    assert bool((tel.true_tv_served[seen] <= tel.served[seen] + 1e-15).all())
    assert tel.bytes_device == sum(walk_device_bytes(layer.store) for layer in cache.layers)
    assert tel.summary()["upgraded_entries"] == tel.upgraded_entries


def test_reads_served_on_tier_b_over_upgraded_entries_are_within_their_partial_bound():
    tel = _validated("qwen2").telemetry()
    on_b = tel.tier_b_reads.repeat_interleave(tel.true_tv.shape[-1] // tel.tier_b_reads.shape[-1], -1)
    assert tel.upgraded_entries > 0 and bool(on_b.any())
    assert bool((tel.true_tv_served[on_b] <= tel.served_partial[on_b]).all())  # per cell of the reads on Tier B
    assert bool((tel.served_partial[on_b] < tel.served[on_b]).any())  # the partial bound is what let them pass


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tau0_with_upgrade_repairs_is_token_identical_to_dynamic_cache(family):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _stepwise(model, ids, DynamicCache(config=model.config), 12)
    storage = StorageConfig(keys="dither-int4", values="int2", write_block=4, **UPGRADE)
    cache = CertifiedCache(model, gate=_gate(0.0), seed=1, storage=storage)
    got = _stepwise(model, ids, cache, 12)
    cache.detach()
    assert torch.equal(ref, got)
    tel = cache.telemetry()
    # at tau = 0 no upgraded radius passes: every read falls back to exact entries, and nothing is upgraded
    assert bool(tel.repaired.any()) and tel.upgraded_entries == 0


def test_upgrades_never_take_the_device_past_its_budget():
    model = tiny_random("qwen2", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    budget = 0.5
    storage = StorageConfig(
        keys="int2", values="int2", write_block=4, device_budget=budget, upgrade_keys="int8", upgrade_values="int4"
    )
    gate = Gate.certified(0.02, granularity="block", block_size=8, persistent=True, box=True)
    cache = CertifiedCache(model, gate=gate, seed=0, storage=storage)
    seen_upgrades = []

    def check(c):
        for layer in c.layers:
            st = layer.store
            records = sum(u.packed.nbytes for ts in (st.k, st.v) for u in ts.upgrades)
            floor, limit = st.bytes_device() - records, budget * st.bytes_fp16()
            assert st.bytes_device() <= max(limit, floor), (st.layer, st.bytes_device(), limit, floor)
            seen_upgrades.append(records)

    _ingested(model, ids, cache, 16, check)
    cache.detach()
    tel = cache.telemetry()
    assert max(seen_upgrades) > 0 and tel.transient_page_ins > 0  # the budget bound and refused some


def test_upgrade_settings_that_cannot_be_served_are_refused():
    model = tiny_random("llama", head_dim=32)
    with pytest.raises(ValueError, match="both codecs or neither"):
        StorageConfig(upgrade_keys="int8")
    with pytest.raises(ValueError, match="upgrade"):
        CertifiedCache(
            model,
            gate=Gate.certified(0.2),
            storage=StorageConfig(keys="int4", values="int4", **UPGRADE | {"upgrade_keys": "int8"}),
            eviction=EvictionConfig.prefill(SnapKV(), 0.5),
        )
    with pytest.raises(ValueError, match="Tier-B"):
        CertifiedCache(model, storage=StorageConfig(keys="dither-int4", values="int4", upgrade_keys="int8",
                                                    upgrade_values="int4"))  # fmt: skip
