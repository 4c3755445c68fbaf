import pytest
import torch
from transformers import DynamicCache

from kvcert import Gate
from kvcert.eval.branching import Scheme, exact_prefill, run_branches
from kvcert.models import tiny_random


@pytest.mark.parametrize("budget", [None, 0.3, 1.0])
def test_scheme_device_budget_reaches_the_cache(budget):
    """``Scheme.device_budget`` is the cache's ``device_budget``: with a persistent gate that repairs every read
    (tau = 0) an uncapped cache keeps every repair, a capped one serves the excess transiently and never holds more
    than its budget of the fp16 bytes on the device."""
    model = tiny_random("llama", seed=0, head_dim=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    gate = Gate.certified(0.0, granularity="block", block_size=16, persistent=True)
    schemes = [
        Scheme("int2", "int2", "int2", device_budget=budget),
        Scheme("int2+gate", "int2", "int2", gate, device_budget=budget),
    ]
    raw, gated = (r.telemetry for r in run_branches(model, ids, schemes, 3, []))
    assert raw is not None and gated is not None
    assert gated.device_budget == raw.device_budget == budget
    floor = raw.bytes_device  # codes, witnesses and pending tokens: what no budget can release
    if budget is None:
        assert gated.transient_page_ins == 0 and gated.bytes_device > floor  # every repair kept
    else:
        assert gated.bytes_device <= max(budget * gated.bytes_fp16, floor)
        if budget * gated.bytes_fp16 < floor:  # no room at all: every persistent repair is served transiently
            assert gated.transient_page_ins > 0 and gated.bytes_device == floor


def test_scheme_default_budget_is_the_library_default():
    assert Scheme("x", "int4", "int4").device_budget == 1.0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_exact_prefill_first_token_and_cache_match_a_full_forward(family):
    """Keeping only the last position's logits changes neither the first token nor the prefilled K/V."""
    model = tiny_random(family, seed=1, head_dim=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    prefill = exact_prefill(model, ids)
    pre, first = prefill.cache, prefill.first
    assert prefill.attentions is None and prefill.logits.shape[1] == 1
    with torch.no_grad():
        full = DynamicCache(config=model.config)
        logits = model(ids, cache=full, use_cache=True).logits
    assert int(first) == int(logits[0, -1].argmax())
    for a, b in zip(pre.layers, full.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
