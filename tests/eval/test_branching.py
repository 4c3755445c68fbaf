import pytest
import torch
from resident_cases import POLICIES, prompt_ids
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate
from kvcert.eval import branching
from kvcert.eval.branching import Scheme, copy_cache, exact_prefill, greedy_from, run_branches
from kvcert.evict import PrefillReads
from kvcert.integrations.transformers import CertifiedCache
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


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_copy_cache_clones_and_transforms_each_layer(family):
    """``copy_cache`` holds clones of every layer's K/V (decoding from it leaves the source as it was, and gives the
    tokens decoding from the source gives); with a transform, layer ``i`` holds what the transform returned for it,
    and a sliding-window layer keeps its count of tokens seen (a Gemma-3 window shorter than the prompt)."""
    model = tiny_random(family, seed=2, head_dim=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(2))
    prefill = exact_prefill(model, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.cache.layers]
    plain = greedy_from(model, prefill.first, copy_cache(model, prefill.cache), 4, [])
    assert all(
        torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        for layer, (k, v) in zip(prefill.cache.layers, before, strict=True)
    )
    seen = []

    def halve(i, keys, values):
        seen.append(i)
        return keys / 2, values + i

    copied = copy_cache(model, prefill.cache, halve)
    assert seen == list(range(len(before)))
    for i, (layer, (k, v)) in enumerate(zip(copied.layers, before, strict=True)):
        assert torch.equal(layer.keys, k / 2) and torch.equal(layer.values, v + i)
        assert getattr(layer, "cumulative_length", None) == getattr(prefill.cache.layers[i], "cumulative_length", None)
    assert plain == greedy_from(model, prefill.first, prefill.cache, 4, [])  # last: it extends the source


def _kept(cache) -> list[torch.Tensor]:
    return [cache.kept_positions(i) for i in range(len(cache.layers))]


@pytest.mark.parametrize("select", ["snapkv", "h2o", "rmm"])
def test_resident_scheme_selects_from_the_real_prefill_attention(select, monkeypatch):
    """A resident scheme through ``run_branches`` keeps the resident set a cache that ran the prefill itself keeps
    (its policy scored by the prefill's real attention, not the key proxy), in every layer, with ``uniform`` and
    ``mass`` allocation; the recording holds only what the policies read."""
    model = tiny_random("llama", seed=0, attn_implementation="sdpa", head_dim=32)
    ids = prompt_ids(model)
    got: list[list[torch.Tensor]] = []

    class Spy(CertifiedCache):
        def ingest(self, past, attentions=None):
            super().ingest(past, attentions)
            got.append(_kept(self))

    monkeypatch.setattr(branching, "CertifiedCache", Spy)
    for alloc in ("uniform", "mass"):
        got.clear()
        scheme = Scheme("r", "none", "none", resident=0.4, select=POLICIES[select], resident_alloc=alloc)
        run_branches(model, ids, [scheme], 2, [])
        own = CertifiedCache(
            model,
            keys="none",
            values="none",
            eviction=EvictionConfig.resident_set(0.4, select=POLICIES[select](), resident_alloc=alloc),
        )
        with torch.no_grad():
            model(ids, cache=own, use_cache=True)
        want = _kept(own)
        own.detach()
        assert len(got) == 1 and len(got[0]) == len(want)
        for a, b in zip(got[0], want, strict=True):
            assert torch.equal(a, b)
        if select == "snapkv" and alloc == "uniform":  # the key-proxy scores (no attention) keep another set here
            proxy = CertifiedCache(
                model, keys="none", values="none", eviction=EvictionConfig.resident_set(0.4, select=POLICIES[select]())
            )
            proxy.ingest(exact_prefill(model, ids).cache)
            assert any(not torch.equal(a, b) for a, b in zip(_kept(proxy), want, strict=True))
            proxy.detach()


def test_recording_only_when_a_scheme_reads_attention(monkeypatch):
    """Dense, quantisation-only and attention-free resident schemes (StreamingLLM) run the plain prefill; a SnapKV
    resident set records its window (plus the newest row) and nothing else."""
    model = tiny_random("llama", seed=0, head_dim=32)
    ids = prompt_ids(model)
    calls: list[PrefillReads] = []
    real = branching.recorded_attention

    def spy(m, reads):
        calls.append(reads)
        return real(m, reads)

    monkeypatch.setattr(branching, "recorded_attention", spy)
    plain = [
        Scheme("dense"),
        Scheme("int4", "int4", "int4"),
        Scheme("s", "int8", "int8", resident=0.5, select=POLICIES["streaming"]),
    ]
    run_branches(model, ids, plain, 2, [])
    assert calls == []
    assert all(not s.prefill_reads.anything for s in plain)
    snap = Scheme("k", "int8", "int8", resident=0.5, select=POLICIES["snapkv"])
    assert snap.prefill_reads == PrefillReads(rows=3)
    assert Scheme("d", "int8", "int8", resident=0.5).prefill_reads == PrefillReads(rows=32)  # default SnapKV(32)
    h2o = Scheme("h", "int8", "int8", resident=0.5, select=POLICIES["h2o"])
    assert h2o.prefill_reads == PrefillReads(rows=1, column_sums=True)
    run_branches(model, ids, [*plain, snap, h2o], 2, [])
    assert calls == [PrefillReads(rows=3, column_sums=True)]
    prefill = exact_prefill(model, ids, snap.prefill_reads)
    assert prefill.attentions is not None and prefill.logits.shape[1] == 1
    assert all(a.rows.shape[2] == 3 and a.column_sums is None for a in prefill.attentions)
