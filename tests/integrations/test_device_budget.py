"""CertifiedCache device bytes and device budget on tiny models: the budget holds after every step, transient
repairs stay exact, fallback_rate is per read, and bytes_device is the sum of the stored tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import Gate, StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

from ..cache.test_device_bytes import walk_device_bytes

torch.set_num_threads(1)


def _stepwise(model, ids, cache, steps, check=None):
    """Prefill then greedy decode, calling ``check(cache)`` after every forward step."""
    out = model(ids, cache=cache, use_cache=True)
    toks = []
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        if check is not None:
            check(cache)
        toks.append(nxt)
        out = model(nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    if check is not None:
        check(cache)
    return torch.cat(toks, 1)


def _ingested(model, ids, cache, steps, check):
    """Shared exact prefill ingested by the cache (as the eval harness runs), then decode with checks."""
    pre = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, cache=pre, use_cache=True)
        cache.ingest(pre)
        nxt = out.logits[:, -1:].argmax(-1)
        toks = []
        for _ in range(steps):
            check(cache)
            toks.append(nxt)
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        check(cache)
    return torch.cat(toks, 1)


def _budget_check(budget, seen):
    """Per layer: ``bytes_device <= max(budget·fp16, floor)`` with the floor what the store holds without the
    repairs it keeps (codes, witnesses, pending entries); literally ``<= budget·fp16`` when the floor fits."""

    def check(cache):
        for layer in cache.layers:
            st = layer.store
            held = sum(int(ts.held.view().sum()) * ts.host.shape[-1] * 2 for ts in (st.k, st.v))
            floor, limit = st.bytes_device() - held, budget * st.bytes_fp16()
            assert st.bytes_device() <= max(limit, floor), (st.layer, st.bytes_device(), limit, floor)
            if floor <= limit:
                assert st.bytes_device() <= limit
        seen.append(sum(layer.store.bytes_device() for layer in cache.layers))

    return check


@pytest.mark.parametrize("granularity", ["block", "head"])
@pytest.mark.parametrize("budget", [1.0, 0.75])
def test_persistent_int2_repair_never_exceeds_the_budget_at_any_step(granularity, budget):
    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    gate = Gate.certified(0.0, granularity=granularity, block_size=8, persistent=True)
    cache = CertifiedCache(
        model, gate=gate, seed=0, storage=StorageConfig(keys="int2", values="int2", write_block=4, device_budget=budget)
    )
    seen = []
    _ingested(model, ids, cache, 20, _budget_check(budget, seen))
    cache.detach()
    tel = cache.telemetry()
    assert len(seen) == 21 and tel.bytes_device <= budget * tel.bytes_fp16
    assert tel.transient_page_ins > 0 and tel.bytes_transient > 0  # the budget did bind
    assert tel.capacity >= 1.0 / budget
    # without a budget the same gate stores more than fp16: the check above is not vacuous
    free = CertifiedCache(
        model, gate=gate, seed=0, storage=StorageConfig(keys="int2", values="int2", write_block=4, device_budget=None)
    )
    _ingested(model, ids, free, 20, lambda c: None)
    free.detach()
    assert free.telemetry().bytes_device > budget * free.telemetry().bytes_fp16


def test_default_budget_keeps_gated_int2_at_or_below_fp16():
    model = tiny_random("qwen2", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = CertifiedCache(
        model,
        seed=0,
        gate=Gate.certified(0.0, granularity="block", block_size=8, persistent=True),
        storage=StorageConfig(keys="int2", values="int2", write_block=4),
    )
    seen = []
    _ingested(model, ids, cache, 12, _budget_check(1.0, seen))
    cache.detach()
    assert cache.telemetry().device_budget == 1.0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tau0_with_binding_budget_is_token_identical_to_dynamic_cache(family):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _stepwise(model, ids, DynamicCache(config=model.config), 12)
    for granularity in ("head", "block"):
        cache = CertifiedCache(
            model,
            gate=Gate.certified(0.0, granularity=granularity, block_size=4, persistent=True),
            storage=StorageConfig(keys="int2", values="int2", write_block=4, device_budget=0.5),
        )
        got = _stepwise(model, ids, cache, 12)
        cache.detach()
        assert torch.equal(ref, got), granularity
        assert cache.telemetry().transient_page_ins > 0


def test_fallback_rate_is_per_read_for_persistent_gates():
    """A persistent gate that makes every head exact at its first compressed read serves every later read
    from those copies: fallback_rate is 1, not 1/steps."""
    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    cache = CertifiedCache(
        model,
        gate=Gate.certified(1e-3, persistent=True),
        seed=0,
        storage=StorageConfig(keys="int4", values="int4", device_budget=None),
    )
    _ingested(model, ids, cache, 10, lambda c: None)
    cache.detach()
    tel = cache.telemetry()
    paged = tel.repaired.flatten(1).any(1)
    assert paged[0] and not paged[1:].any()  # every head paged in at the first read, never again
    assert tel.fallback_rate == 1.0  # ... and served from those copies at every read


def test_telemetry_bytes_device_is_the_sum_over_layers_of_the_stored_tensors():
    model = tiny_random("mistral", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
    cache = CertifiedCache(
        model,
        keys="dither-int8",
        values="int4",
        seed=0,
        gate=Gate.certified(0.05, granularity="block", block_size=8, persistent=True),
    )
    _stepwise(model, ids, cache, 6)
    cache.detach()
    tel = cache.telemetry()
    assert tel.bytes_device == sum(walk_device_bytes(layer.store) for layer in cache.layers)
    s = tel.summary()
    assert s["bytes_device"] == tel.bytes_device and s["capacity"] == tel.bytes_fp16 / tel.bytes_device
    assert s["bytes_paged"] == tel.bytes_paged and s["page_in_ratio"] == tel.bytes_paged / tel.bytes_fp16
    assert "bytes_stored" in s and "measured" in tel.tiers["bytes_device"]
    with pytest.warns(DeprecationWarning, match="capacity"):
        assert tel.effective_bits > 0


def test_device_budget_rejects_bad_values():
    model = tiny_random("llama", head_dim=32)
    with pytest.raises(ValueError, match="device_budget"):
        CertifiedCache(model, storage=StorageConfig(keys="int4", values="int4", device_budget=-1.0))
