"""Periodic re-selection of a resident set (``EvictionConfig.resident_set(R, reselect=N)``), ranked by the key proxy
or by the decode queries (``reselect_score``): exactness at tau = 0, per-cell soundness in validate mode, what it moves
and pages in, held tokens carried across the re-paging, the device budget, bad arguments."""

from __future__ import annotations

import pytest
import torch
from resident_cases import POLICIES, PROMPT, greedy_decode, prompt_ids, resident_cache, validated_runs
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.attention.resident import held_by_position
from kvcert.evict import H2O, PrefillAttention, SnapKV
from kvcert.evict.base import aggregate_gqa, causal_attention, prefill_kept_count
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 7
SCORES = ("key_proxy", "decode")


def _ids(model, batch=2, seed=0):
    return prompt_ids(model, batch=batch, seed=seed)


def _decode(model, ids, cache, steps=STEPS, each=None):
    return greedy_decode(model, ids, cache, steps, each)


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=32) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tau_zero_with_reselect_is_token_identical_to_dynamic_cache(models, family, policy):
    model = models[family]
    ids = _ids(model)
    ref = _decode(model, ids, DynamicCache(config=model.config))
    for every, score in ((1, "key_proxy"), (3, "key_proxy"), (1, "decode"), (3, "decode")):
        with resident_cache(model, "int4", policy, Gate.certified(0.0), reselect=every, reselect_score=score) as cache:
            assert torch.equal(_decode(model, ids, cache), ref)
            stats = cache.reselect_stats
            # "decode" re-selects once a decode query has been read: not before the write of step 1
            due = STEPS // every - (score == "decode" and every == 1)
            assert stats is not None and stats.reselections == model.config.num_hidden_layers * due


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
@pytest.mark.parametrize(
    ("codec", "summary", "recall"),
    [
        ("int4", "int8", "persistent"),
        ("none", "int8", "persistent"),
        ("none", "box", "transient"),
        ("int4", "basis8", "persistent"),
    ],
)
@pytest.mark.parametrize("score", SCORES)
def test_validate_mode_zero_violations_in_every_cell_with_reselect(
    models, family, policy, codec, summary, recall, score
):
    """Every (step, layer, row, query head) cell: true TV <= certificate, exact omitted mass <= its bound, with the
    resident set re-selected every 2 decode steps by either score (quantized and exact resident storage, int8 and
    box and basis8 summaries, persistent and transient recall; gated and ungated)."""
    model = models[family]
    ids = _ids(model, seed=1)
    runs = validated_runs(
        model, ids, codec, policy, STEPS, summary=summary, recall=recall, reselect=2, reselect_score=score
    )
    for _, tel in runs:  # each run checked per cell, the gated one at most TAU in every served cell
        assert tel.reselect is not None and tel.reselect.promoted > 0


def test_reselect_moves_tokens_pages_them_in_and_keeps_the_resident_fraction(models):
    """Transient recall (nothing held): every promoted token is paged in (K and V in the host dtype); right after a
    re-selection each (layer, KV head) holds ``ceil(R · T)`` tokens; ``bytes_paged`` includes the promotions."""
    model = models["llama"]
    ids = _ids(model, seed=2)
    d, layers, hkv = 32, model.config.num_hidden_layers, model.config.num_key_value_heads
    sizes = []
    with resident_cache(model, "int8", "h2o", Gate.certified(0.3), recall="transient", reselect=3) as cache:
        _decode(model, ids, cache, each=lambda c: sizes.append([layer.store.n for layer in c._layers]))
        tel = cache.telemetry()
        stats = cache.reselect_stats
    assert stats is not None and stats.promoted > 0 and stats.demoted > 0
    assert stats.bytes_paged == stats.promoted * 2 * d * 4  # float32 host copies of the tiny model
    s = tel.summary()
    assert s["reselections"] == stats.reselections == layers * (STEPS // 3)
    assert s["reselect_promoted"] == stats.promoted and s["reselect_bytes_paged"] == stats.bytes_paged
    assert tel.bytes_paged >= tel.bytes_recalled + stats.bytes_paged
    assert tel.tiers["reselect"].startswith("measured")
    # the read of decode step s (s % 3 == 0) follows a re-selection over the PROMPT + s tokens written by then
    for step in range(1, STEPS + 1):
        if step % 3 == 0:
            want = prefill_kept_count(PROMPT + step - 1, 0.75) + 1  # the re-selected set, then this step's token
            assert sizes[step - 1] == [want] * layers
    # tokens promoted and demoted balance the resident counts: prompt selection + decode tokens - net demotion
    prefill = prefill_kept_count(PROMPT, 0.75)
    assert sizes[-1][0] * 2 * hkv == (prefill + STEPS) * 2 * hkv + (stats.promoted - stats.demoted) // layers


@pytest.mark.parametrize("codec", ["int4", "none"])
@pytest.mark.parametrize("score", SCORES)
def test_bytes_device_never_exceeds_the_device_budget_with_reselect(models, codec, score):
    """After every decode step: bytes_device (stores + summaries + held pages) within device_budget x the context's
    fp16 K/V, up to the tokens the later layers appended after the forward's budget check (the persistent-recall
    contract of ``tests/attention/test_resident.py``: one exact float32 token per layer, row and KV head)."""
    model = models["qwen2"]
    ids = _ids(model, seed=3)
    cfg = model.config
    slack = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 2 * 32 * 4
    seen = []

    def check(cache):
        tel = cache.telemetry()
        stores = sum(layer.store.bytes_device() for layer in cache.layers)
        assert tel.bytes_device == stores + tel.bytes_summary + tel.bytes_held
        seen.append(tel.bytes_device)
        assert tel.bytes_device <= 1.0 * tel.bytes_fp16_context + slack

    with resident_cache(
        model,
        codec,
        "snapkv",
        Gate.certified(0.05),
        storage=StorageConfig(device_budget=1.0),
        reselect=2,
        reselect_score=score,
    ) as cache:
        _decode(model, ids, cache, each=check)
        assert cache.reselect_stats is not None and cache.reselect_stats.reselections > 0
    assert len(seen) == STEPS


@pytest.mark.parametrize(
    ("kwargs", "keys", "match"),
    [
        ({"reselect": 0}, "int8", "reselect must be a positive int"),
        ({"reselect": -2}, "int8", "reselect must be a positive int"),
        ({"reselect": 1.5}, "int8", "reselect must be a positive int"),
        ({"reselect": True}, "int8", "reselect must be a positive int"),
        ({"reselect": 2}, "dither-int8", "dithered codec 'dither-int8'"),
        ({"reselect": 2, "reselect_score": "bogus"}, "int8", "reselect_score must be one of .* 'bogus'"),
        ({"reselect": 2, "reselect_score": None}, "int8", "reselect_score must be one of .* None"),
    ],
)
def test_bad_reselect_arguments_raise_clear_errors(models, kwargs, keys, match):
    with pytest.raises(ValueError, match=match):
        resident = EvictionConfig.resident_set(0.25, **kwargs)
        CertifiedCache(models["llama"], keys=keys, values="int8", gate=Gate.certified(0.2), eviction=resident)


def test_reselect_without_a_resident_set_is_refused() -> None:
    with pytest.raises(ValueError, match="reselect=N re-selects a resident set"):
        EvictionConfig(reselect=4)


def _held_and_omitted(evictor, store) -> tuple[torch.Tensor, torch.Tensor]:
    """``(held, omitted)`` ``[B, Hkv, T]`` over logical positions of one resident layer, from the driver's pages."""
    archive = store.evicted["positions"].view()
    held, _ = held_by_position(evictor.pages[store.layer], archive, store.appended)
    return held, torch.zeros_like(held).scatter(-1, archive.to(held.device), True)


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("page_size", [3, 4])
def test_held_tokens_that_stay_omitted_stay_held_across_a_re_paging(models, score, page_size):
    """Persistent recall without a device budget (the pool never binds), checked around every re-selection: each
    token held on the device before it that stays omitted is still held after it — the re-selection re-pages the
    archive (promoted and demoted tokens shift every page boundary) but carries the held tokens into whole pages
    instead of handing them back to their summaries (the old behaviour: the next recall paged them in again). The
    re-selection's page-in is exactly the promoted tokens not held before plus the tokens completing a held page."""
    model = models["llama"]
    ids = _ids(model, seed=4)
    d = 32
    seen = {"carried": 0, "paged": 0}
    with resident_cache(
        model,
        "int4",
        "snapkv",
        Gate.certified(0.05),
        storage=StorageConfig(device_budget=None),
        page_size=page_size,
        reselect=2,
        reselect_score=score,
    ) as cache:
        evictor = cache._evictor
        reselect = evictor._reselect

        def checked(store):
            held0, omitted0 = _held_and_omitted(evictor, store)
            paged0 = evictor.reselect_stats.bytes_paged
            reselect(store)
            held1, omitted1 = _held_and_omitted(evictor, store)
            stay = held0 & omitted1
            assert bool(held1[stay].all())  # carried, not handed back
            promoted = omitted0 & ~omitted1
            want = int((promoted & ~held0).sum()) + int((held1 & ~stay).sum())
            assert evictor.reselect_stats.bytes_paged - paged0 == want * 2 * d * 4  # float32 K and V
            seen["carried"] += int(stay.sum())
            seen["paged"] += want

        evictor._reselect = checked
        _decode(model, ids, cache)
        stats = cache.reselect_stats
    assert stats is not None and stats.promoted > 0 and stats.demoted > 0
    assert seen["carried"] > 0 and stats.bytes_paged == seen["paged"] * 2 * d * 4


def test_keep_ranked_is_the_prefill_rule_with_given_scores():
    """``EvictionPolicy.keep_ranked`` keeps what ``prefill_keep`` keeps when handed the prefill's own scores (the
    policy's protected sinks / recent window first, then the highest scores), for H2O and SnapKV."""
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 3, 30, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g)
    attn = causal_attention(torch.randn(2, 6, 30, 8, generator=g), keys)
    for policy in (H2O(recent=4), SnapKV(window=5, kernel=3)):
        want = policy.prefill_keep(0, keys, values, 0.6, attn=attn)
        positions = torch.arange(30).expand(2, 3, 30)
        scores = policy._prefill_scores(
            0, PrefillAttention(aggregate_gqa(attn, 3, "sum"), 30, group=2), positions, None
        )
        assert torch.equal(policy.keep_ranked(scores, 0.6), want)
    assert torch.equal(H2O(recent=4).keep_ranked(torch.zeros(1, 1, 5), 0.0), torch.arange(5).expand(1, 1, 5))
