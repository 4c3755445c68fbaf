"""Query Gram matrices (``kvcert.attention.query_gram``) and the query-aware summary that a resident set builds from
them (``summary="basis8-qspec"``, ``docs/math.md#query-aware-basis``): the Gram per element, what the driver
accumulates (the prefill rows the policy reads — in the cache's own prefill and in an ingested recording — then every
decode query), the basis each summary is built in, and per-cell soundness in validate mode on every tiny family."""

from __future__ import annotations

import pytest
import torch
from resident_cases import (
    POLICIES,
    assert_sound_in_every_cell,
    greedy_decode,
    prompt_ids,
    resident_cache,
    validated_runs,
)
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert import Gate
from kvcert.attention.evict_driver import ingest_reads
from kvcert.attention.query_gram import QueryGrams, query_gram
from kvcert.bounds import pages as pg
from kvcert.eval.branching import exact_prefill
from kvcert.integrations.attention_impl import swapped_attention
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

F64 = torch.float64
D = 32
STEPS = 5


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=D) for family in ("llama", "qwen2", "mistral", "gemma3")}


def test_query_gram_sums_each_kv_heads_group_per_element():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, generator=gen)
    q[1, 4, 2, 1] = float("nan")  # that row is left out
    q[0, 0, 3, 0] = float("inf")
    got = query_gram(q, 2)
    want = torch.zeros(2, 2, 4, 4, dtype=F64)
    for b in range(2):
        for h in range(6):
            for m in range(5):
                row = q[b, h, m].to(F64)
                if bool(torch.isfinite(row).all()):
                    want[b, h // 3] += torch.outer(row, row)
    assert torch.equal(got, want)
    grams = QueryGrams()
    assert grams.get(3) is None
    grams.add(3, got)
    grams.add(3, got)
    assert torch.equal(grams.get(3), 2 * want)
    grams.clear()
    assert grams.get(3) is None
    with pytest.raises(ValueError, match="multiple of 4"):
        query_gram(q, 4)
    with pytest.raises(ValueError, match=r"\[B, Hq, Q, D\]"):
        query_gram(q[0], 2)


def _queries(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's post-RoPE queries ``[B, Hq, S, D]`` of a plain forward of ``ids``."""
    seen: dict[int, torch.Tensor] = {}

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        seen[module.layer_idx] = query.detach().clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)

    with swapped_attention(model, "kvcert-test-queries", record, mask=None), torch.no_grad():
        model(ids)
    return [seen[i] for i in sorted(seen)]


def _check_rebuilt(cache, grams: QueryGrams, before: dict) -> int:
    """For every layer whose summary was rebuilt since ``before`` (layer -> summary object): its head basis is the
    query-aware basis (:func:`~kvcert.bounds.pages.query_aware_basis`) of the archive it summarises and the layer's Gram
    now, stored in float32. Returns how many were."""
    rebuilt = 0
    for layer, pages in cache._pages.items():
        if before.get(layer) is pages:
            continue
        keys = cache.layers[layer].store.evicted["k"].view()
        want = pg.query_aware_basis(keys, grams.get(layer))[..., :8].to(torch.float32)
        assert torch.equal(pages.sketch.basis, want)
        rebuilt += 1
    return rebuilt


@pytest.mark.parametrize("ingested", [False, True])
def test_the_driver_accumulates_the_prefill_rows_and_every_decode_query(models, ingested):
    """After the prefill (the cache's own, or an ingested recording) each layer's Gram is that of the newest query rows
    the policy reads (SnapKV: its window); each decode step adds its query. Checked against the queries of a plain
    forward over the decoded tokens: at tau = 0 every read is exact (the tokens are the dense ones)."""
    model = models["llama"]
    hkv = model.config.num_key_value_heads
    ids = prompt_ids(model, batch=1, seed=4)
    rows = ingest_reads(POLICIES["snapkv"]()).rows
    s = ids.shape[1]
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), STEPS)
    pre = exact_prefill(model, ids, ingest_reads(POLICIES["snapkv"]()))  # the branching path's recorded prefill
    with resident_cache(model, "none", "snapkv", Gate.certified(0.0), summary="basis8-qspec", recall="swap") as cache:
        if ingested:
            cache.ingest(pre.cache, pre.attentions)
            toks = [pre.first]
        else:
            toks = [model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)]
        grams = cache._evictor.query_grams
        for layer, q in enumerate(_queries(model, ids)):
            assert torch.allclose(grams.get(layer), query_gram(q[:, :, s - rows :], hkv), rtol=1e-4, atol=1e-6)
        for _ in range(STEPS - 1):
            toks.append(model(toks[-1], cache=cache, use_cache=True).logits[:, -1:].argmax(-1))
        assert torch.equal(torch.cat(toks, 1), ref)
        for layer, q in enumerate(_queries(model, torch.cat([ids, *toks[:-1]], 1))):
            assert torch.allclose(grams.get(layer), query_gram(q[:, :, s - rows :], hkv), rtol=1e-4, atol=1e-5)


def test_every_summary_is_built_in_the_query_aware_basis_of_its_archive_and_gram(models):
    """The prefill's summaries and every one a swap rebuilds (tau = 0.1, so swaps happen): the head basis is
    :func:`~kvcert.bounds.pages.query_aware_basis` of the archive it summarises and its layer's Gram at that moment."""
    model = models["qwen2"]
    ids = prompt_ids(model, batch=2, seed=8)
    with resident_cache(model, "int4", "snapkv", Gate.certified(0.1), summary="basis8-qspec", recall="swap") as cache:
        tok = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        grams = cache._evictor.query_grams
        assert _check_rebuilt(cache, grams, {}) == model.config.num_hidden_layers
        rebuilt = 0
        for _ in range(STEPS):
            before = dict(cache._pages)
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            rebuilt += _check_rebuilt(cache, grams, before)
        assert rebuilt > 0 and cache.reselect_stats.promoted > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize(
    ("summary", "recall"), [("basis8-qspec", "swap"), ("basis8-qspec", "persistent"), ("basis16-qspec", "swap")]
)
def test_validate_mode_zero_violations_in_every_cell_with_the_query_aware_summary(models, family, summary, recall):
    """Every (step, layer, row, query head) cell of a validate-mode run with query-aware summaries (rank 8 and 16),
    ungated and gated: true TV <= certificate, exact omitted mass <= its bound, output error <= its bound (int4
    resident codes)."""
    model = models[family]
    ids = prompt_ids(model, batch=2, seed=6)
    for _, tel in validated_runs(model, ids, "int4", "snapkv", STEPS, summary=summary, recall=recall):
        assert_sound_in_every_cell(tel)
