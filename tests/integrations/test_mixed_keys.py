"""CertifiedCache with an allocation's per-(layer, KV head) dithered key widths (``dither-mixed``) and value codecs
(``mixed[...]`` where a layer's heads differ): 0 violations per cell in validate mode on every tiny family and
SmolLM2, Gate.certified(0) token-identical
to DynamicCache, and the stores' device bytes those of the stored tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import CertifiedCache, Gate, StorageConfig
from kvcert.models.tiny import tiny_random
from kvcert.quant import Allocation
from kvcert.quant.per_head import PerHeadCodec

WIDTHS = (8, 6, 5, 4, 3)


def _allocation(model) -> Allocation:
    cfg = model.config.get_text_config()
    layers, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    bits = tuple(tuple(WIDTHS[(layer + h) % len(WIDTHS)] for h in range(kv)) for layer in range(layers))
    # per KV head: a mixed value codec on layers whose heads differ (every layer when kv > 1), one codec otherwise
    codecs = ("int4", "kivi-2", "int8", "int2")
    values = tuple(tuple(codecs[(layer + h) % 4] for h in range(kv)) for layer in range(layers))
    return Allocation(bits, values, tau=0.2, max_loss=0.02)


def _storage(alloc: Allocation, **kw) -> StorageConfig:
    return StorageConfig(keys=alloc.key_codecs(), values=alloc.value_codecs(), **kw)


def _decode(model, ids, cache, steps):
    out = model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_mixed_keys_validate_zero_violations_and_measured_bytes(family):
    model = tiny_random(family, head_dim=32)
    alloc = _allocation(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = CertifiedCache(model, validate=True, seed=3, storage=_storage(alloc, write_block=4))
    _decode(model, ids, cache, 8)
    cache.detach()
    tel = cache.telemetry()
    assert tel.cells > 0 and tel.violations == 0 and tel.out_violations == 0, tel.summary()
    assert tel.tier_b is not None  # every layer's keys are dithered: Tier B is recorded
    stores = [layer.store for layer in cache.layers]
    for layer, store in enumerate(stores):
        assert store.k.codec.head_bits == alloc.key_bits[layer]
        want = alloc.values[layer]
        assert store.v.codec.name == (want[0] if len(set(want)) == 1 else f"mixed[{','.join(want)}]")
        packed = sum(t.nbytes for ts in (store.k, store.v) for c in ts.chunks for t in c.packed.tensors.values())
        assert store.k.packed_nbytes() + store.v.packed_nbytes() == packed > 0
    assert tel.bytes_device == sum(s.bytes_device() for s in stores)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_mixed_keys_repair_everything_equals_dynamic_cache(family):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _decode(model, ids, DynamicCache(config=model.config), 10)
    cache = CertifiedCache(model, gate=Gate.certified(0.0), storage=_storage(_allocation(model)))
    got = _decode(model, ids, cache, 10)
    cache.detach()
    assert torch.equal(ref, got)


def test_a_per_layer_tuple_of_another_length_than_the_model_is_refused():
    """Shorter (a layer without a codec) and longer (an allocation of another model, whose extra layers would be
    dropped silently) are both refused at construction, as is a per-head codec built for another KV-head count."""
    model = tiny_random("llama", head_dim=32)
    alloc = _allocation(model)
    n = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=f"keys lists codecs for 1 layers; the model has {n} decoder layers"):
        CertifiedCache(model, storage=StorageConfig(keys=alloc.key_codecs()[:1], values="int4"))
    longer = alloc.value_codecs() + alloc.value_codecs()[:1]
    with pytest.raises(ValueError, match=f"values lists codecs for {n + 1} layers; the model has {n} decoder layers"):
        CertifiedCache(model, storage=StorageConfig(keys="int8", values=longer))
    heads = model.config.num_key_value_heads
    wide = PerHeadCodec(["int4"] * (heads + 1))
    with pytest.raises(ValueError, match=f"built for {heads + 1} KV heads; the model has {heads}"):
        CertifiedCache(model, storage=StorageConfig(keys="int8", values=wide))
    with pytest.raises(TypeError, match="tuple of them"):
        StorageConfig(keys=("int8", 3))
    with pytest.raises(TypeError, match="tuple of them"):
        StorageConfig(values=())


@pytest.mark.real_model
def test_mixed_keys_validate_zero_violations_smollm2(smollm2_model):
    model, tok = smollm2_model
    alloc = _allocation(model)
    ids = tok("In a hole in the ground there lived a hobbit. The capital of France is", return_tensors="pt").input_ids
    cache = CertifiedCache(model, validate=True, seed=0, storage=_storage(alloc))
    _decode(model, ids, cache, 3)
    cache.detach()
    tel = cache.telemetry()
    assert tel.cells >= 2 * 30 * 9
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
