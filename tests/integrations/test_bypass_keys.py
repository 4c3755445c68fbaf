"""CertifiedCache with outlier-bypass keys (``<codec>+bypass<m>``, alone and around a per-head ``dither-mixed``): 0
violations per cell in validate mode on every tiny family, Gate.certified(0) token-identical to DynamicCache, and the
device bytes those of the stored tensors (the bypassed channels in fp16 included)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import CertifiedCache, Gate, StorageConfig
from kvcert.models.tiny import tiny_random
from kvcert.quant import OutlierBypass
from kvcert.quant.dither import DitherCodec


def _decode(model, ids, cache, steps):
    out = model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


def _mixed_bypass(model) -> tuple[OutlierBypass, ...]:
    cfg = model.config.get_text_config()
    widths = (8, 3, 5, 6)
    return tuple(
        OutlierBypass(DitherCodec(head_bits=tuple(widths[(layer + h) % 4] for h in range(cfg.num_key_value_heads))), 2)
        for layer in range(cfg.num_hidden_layers)
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("keys", ["dither-int8+bypass2", "int4+bypass2", "mixed"])
def test_bypass_keys_validate_zero_violations_and_measured_bytes(family, keys):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    chosen = _mixed_bypass(model) if keys == "mixed" else keys
    storage = StorageConfig(keys=chosen, values="int4", write_block=4)
    cache = CertifiedCache(model, validate=True, seed=3, storage=storage)
    _decode(model, ids, cache, 8)
    cache.detach()
    tel = cache.telemetry()
    assert tel.cells > 0 and tel.violations == 0 and tel.out_violations == 0, tel.summary()
    stores = [layer.store for layer in cache.layers]
    for store in stores:
        assert "+bypass2" in store.k.codec.name
        packed = sum(t.nbytes for ts in (store.k, store.v) for c in ts.chunks for t in c.packed.tensors.values())
        assert store.k.packed_nbytes() + store.v.packed_nbytes() == packed > 0
    assert tel.bytes_device == sum(s.bytes_device() for s in stores)


@pytest.mark.parametrize("keys", ["dither-int8+bypass2", "mixed"])
def test_bypass_keys_repair_everything_equals_dynamic_cache(keys):
    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _decode(model, ids, DynamicCache(config=model.config), 10)
    chosen = _mixed_bypass(model) if keys == "mixed" else keys
    cache = CertifiedCache(model, gate=Gate.certified(0.0), storage=StorageConfig(keys=chosen, values="int4"))
    got = _decode(model, ids, cache, 10)
    cache.detach()
    assert torch.equal(ref, got)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_transient_block_repair_keeps_nothing_and_certified_zero_equals_dynamic_cache(family):
    """The transient block gate (``certified:TAU:block-transient``) with bypass keys: at τ = 0 every read with a
    positive certificate is served from paged-in exact blocks, so the greedy tokens are DynamicCache's; at τ = 1e-4
    (below these tiny models' certificates) validate mode counts no violation, page-ins are counted, and the device
    bytes are those of the ungated cache (nothing is kept)."""
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = _decode(model, ids, DynamicCache(config=model.config), 10)
    storage = StorageConfig(keys="dither-int8+bypass2", values="int4", write_block=4)
    zero = CertifiedCache(model, seed=3, gate=Gate.certified(0.0, granularity="block", block_size=8), storage=storage)
    assert torch.equal(ref, _decode(model, ids, zero, 10))
    zero.detach()
    bytes_device = {}
    for name, gate in (("off", Gate.off()), ("transient", Gate.certified(1e-4, granularity="block", block_size=8))):
        cache = CertifiedCache(model, validate=True, seed=3, gate=gate, storage=storage)
        _decode(model, ids, cache, 10)
        cache.detach()
        tel = cache.telemetry()
        assert tel.cells > 0 and tel.violations == 0 and tel.out_violations == 0, tel.summary()
        bytes_device[name] = tel.bytes_device
        if name == "transient":
            assert tel.bytes_paged > 0 and all(layer.store.n_held == 0 for layer in cache.layers)
    assert bytes_device["transient"] == bytes_device["off"]
