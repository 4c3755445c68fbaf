"""CertifiedCache with compact ("log8") witnesses and the narrow dithered key codec on every tiny family and on
SmolLM2: validate mode finds 0 violations per cell, every certificate and output bound is at least the "f32" one
on the same writes (the witnesses only grow), and Gate.certified(0) is token-identical to DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import CertifiedCache, Gate, StorageConfig
from kvcert.models.tiny import tiny_random

SCHEMES = [
    ("dither-int8", "int4"),
    ("dither-int6", "int2"),
    ("dither-int4", "int4"),
    ("dither-int3", "int2"),
    ("int4", "kivi-2"),
]


def _decode(model, ids, cache, steps):
    """Greedy continuation of ``steps`` tokens through ``cache`` (transformers' generate)."""
    out = model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("keys,values", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_log8_validate_zero_violations_and_certificates_only_grow(family, keys, values):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    tels = {}
    for witness in ("f32", "log8"):
        cache = CertifiedCache(
            model,
            validate=True,
            seed=3,
            storage=StorageConfig(keys=keys, values=values, write_block=1, witness=witness),
        )
        _decode(model, ids, cache, 8)
        cache.detach()
        tels[witness] = tel = cache.telemetry()
        assert tel.cells > 0 and tel.violations == 0 and tel.out_violations == 0, tel.summary()
    f32, log8 = tels["f32"], tels["log8"]
    rec = log8.recorded
    assert torch.equal(rec, f32.recorded)
    # identical served K/V, witnesses only larger: every certificate and output bound is at least the f32 one
    assert torch.all(log8.raw[rec] >= f32.raw[rec] - 1e-12)
    assert torch.all(log8.out_bound[rec] >= f32.out_bound[rec] - 1e-12)
    assert log8.bytes_witness < f32.bytes_witness / 3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("keys", ["dither-int6", "dither-int4", "dither-int3"])
def test_log8_repair_everything_equals_dynamic_cache(family, keys):
    model = tiny_random(family, head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _decode(model, ids, DynamicCache(config=model.config), 10)
    cache = CertifiedCache(
        model, gate=Gate.certified(0.0), storage=StorageConfig(keys=keys, values="int2", witness="log8")
    )
    got = _decode(model, ids, cache, 10)
    cache.detach()
    assert torch.equal(ref, got)


@pytest.mark.real_model
@pytest.mark.parametrize(
    "keys,values", [("dither-int8", "int4"), ("dither-int6", "int2"), ("dither-int4", "int4"), ("dither-int3", "int4")]
)
def test_log8_validate_zero_violations_smollm2(smollm2_model, keys, values):
    model, tok = smollm2_model
    ids = tok("In a hole in the ground there lived a hobbit. The capital of France is", return_tensors="pt").input_ids
    cache = CertifiedCache(
        model, validate=True, seed=0, storage=StorageConfig(keys=keys, values=values, witness="log8")
    )
    _decode(model, ids, cache, 3)
    cache.detach()
    tel = cache.telemetry()
    assert tel.cells >= 2 * 30 * 9  # two decode reads (generate runs no forward after the last token)
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
