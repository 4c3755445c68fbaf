"""Resident set, page summaries and recall in CertifiedCache: per-cell soundness, exactness at tau = 0, accounting."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from resident_cases import POLICIES, PROMPT, greedy_decode, resident_cache, validated_runs
from resident_cases import prompt_ids as _ids
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, StorageConfig, ValidationConfig
from kvcert.attention.resident import can_omit
from kvcert.cache.store import LayerStore
from kvcert.cache.telemetry import Telemetry
from kvcert.evict import H2O
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 6


def _decode(model, ids, cache, steps=STEPS):
    return greedy_decode(model, ids, cache, steps)


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=32) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tau_zero_is_token_identical_to_dynamic_cache(models, family, policy):
    model = models[family]
    ids = _ids(model, batch=2)
    ref = _decode(model, ids, DynamicCache(config=model.config))
    for resident in (0.1, 0.5):
        with resident_cache(model, "int4", policy, Gate.certified(0.0), resident=resident) as cache:
            assert torch.equal(_decode(model, ids, cache), ref)
            tel = cache.telemetry()
            assert tel.resident_fraction < 1 and tel.summary()["bytes_summary"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("summary", ["basis8", "basis16", "basis8-t2"])
def test_tau_zero_with_the_basis_sketch_is_token_identical_to_dynamic_cache(models, family, summary):
    tel = _tau_zero_identical(models[family], "int4", "snapkv", summary)
    assert tel.summary()["bytes_summary"] > 0


def _tau_zero_identical(model, codec: str, policy: str, summary: str) -> Telemetry:
    """Decode a batch-2 prompt with a ``resident=0.25`` cache gated at τ = 0; assert the tokens are those of
    ``DynamicCache`` and return the cache's telemetry."""
    ids = _ids(model, batch=2, seed=5)
    ref = _decode(model, ids, DynamicCache(config=model.config))
    with resident_cache(model, codec, policy, Gate.certified(0.0), summary=summary) as cache:
        assert torch.equal(_decode(model, ids, cache), ref)
        return cache.telemetry()


@pytest.mark.parametrize(("summary", "tail_bits"), [("basis8", 4), ("basis8-t2", 2)])
def test_basis_summary_bytes_are_its_stored_tensors(models, summary, tail_bits):
    """``bytes_summary`` of a ``basis8`` / ``basis8-t2`` resident set: per (layer, KV head) the head basis ``D×8``
    and tail basis ``D×(D − 8)`` (float32 / float16; float16 / float8 e4m3 with the 2-bit tail), per omitted token
    8 int8 + ``D − 8`` packed int4 (2-bit) codes and five bfloat16 numbers, plus the three float32 value / key norm
    bounds — and it matches the stored tensors byte for byte."""
    model = models["llama"]
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, 32
    with resident_cache(model, "int8", "streaming", None, summary=summary) as cache:
        _decode(model, _ids(model, seed=2), cache, steps=1)
        tel = cache.telemetry()
        omitted = PROMPT - (PROMPT - math.floor(0.75 * PROMPT + 1e-9))
        tail = (d - 8) * tail_bits // 8
        head, tail_entry = (4, 2) if tail_bits == 4 else (2, 1)  # float32 / float16 or float16 / float8 bases
        per_layer = hkv * (d * 8 * head + d * (d - 8) * tail_entry + omitted * (8 + tail + 5 * 2)) + 3 * hkv * 4
        assert tel.bytes_summary == cfg.num_hidden_layers * per_layer
        sketches = [p.sketch for p in cache._pages.values()]
        assert all(sk.tail_bits == tail_bits for sk in sketches)
        stored = sum(
            t.numel() * t.element_size()
            for sk in sketches
            for t in (
                sk.basis,
                sk.tail,
                sk.codes,
                sk.tail_codes,
                sk.scale,
                sk.tail_scale,
                sk.coef_err,
                sk.perp_err,
                sk.norm,
            )
        )
        assert tel.bytes_summary == stored + cfg.num_hidden_layers * 3 * hkv * 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    ("codec", "summary"),
    [
        ("none", "int8"),
        ("int8", "int8"),
        ("int4", "int8"),
        ("int8", "box"),
        ("int4", "basis8"),
        ("none", "basis16"),
        ("int4", "basis8-t2"),
    ],
)
def test_validate_mode_zero_violations_in_every_cell(models, family, policy, codec, summary):
    model = models[family]
    ids = _ids(model, batch=2, seed=1)
    for gate, tel in validated_runs(model, ids, codec, policy, STEPS, summary=summary):
        rec = tel.recorded
        if gate.mode == "certified":  # recall brought every served cell under tau without a dense fallback
            assert tel.pages_recalled > 0 and tel.bytes_recalled > 0
            # the omitted tokens hold attention here, so some reads must recall: the floor is positive
            assert tel.bytes_recall_floor is not None and 0 < tel.bytes_recall_floor <= tel.bytes_paged
            assert tel.summary()["bytes_recall_floor"] == tel.bytes_recall_floor
        else:
            assert tel.pages_recalled == 0 and torch.equal(tel.served[rec], tel.certificates[rec])
            assert tel.bytes_recall_floor is None


def test_accounting_of_summaries_recall_and_resident_fraction(models):
    model = models["llama"]
    ids = _ids(model, seed=2)
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, 32
    with resident_cache(model, "int8", "streaming", Gate.certified(0.3), page_size=5, summary="box") as cache:
        _decode(model, ids, cache)
        tel = cache.telemetry()
        kept = PROMPT - math.floor(0.75 * PROMPT + 1e-9)
        omitted = PROMPT - kept
        assert omitted % 5 == 0  # full pages only: every recalled page holds 5 tokens
        pages = omitted // 5
        per_layer = hkv * pages * (3 * d * 2 + 2 * 4) + pages * 8 + 3 * hkv * 4  # box, centre; radius, norm
        assert tel.bytes_summary == cfg.num_hidden_layers * per_layer
        assert tel.resident_fraction == pytest.approx((kept + STEPS) / (PROMPT + STEPS))
        # key-first recall: the keys of every recalled page, the values of whole pages among them (fp32 host copies
        # of the tiny model), counted apart; their sum is the recall's page-in
        assert tel.pages_recalled > 0
        assert tel.bytes_recalled_keys == tel.pages_recalled * 5 * d * 4
        assert tel.bytes_recalled_values % (5 * d * 4) == 0 and 0 < tel.bytes_recalled_values
        assert tel.bytes_recalled_values <= tel.bytes_recalled_keys  # values of a subset of the keyed pages
        assert tel.bytes_recalled == tel.bytes_recalled_keys + tel.bytes_recalled_values
        assert tel.bytes_stored < tel.bytes_fp16  # summaries are counted apart from the stored codes
        # fp16 K/V of every written token (resident + omitted, all layers); bytes_fp16 holds the resident ones only
        written = cfg.num_hidden_layers * hkv * (PROMPT + STEPS) * 2 * d * 2
        assert tel.bytes_fp16_context == written
        assert tel.bytes_fp16 == cfg.num_hidden_layers * hkv * (kept + STEPS) * 2 * d * 2
        s = tel.summary()
        assert s["bytes_fp16_context"] == written
        assert s["pages_recalled"] == tel.pages_recalled and s["resident_fraction"] == tel.resident_fraction
        assert s["bytes_recalled"] == s["bytes_recalled_keys"] + s["bytes_recalled_values"] == tel.bytes_recalled
        assert s["recall_violations"] is None and s["bytes_recall_floor"] is None  # not validated
        assert 0 < s["mean_omitted_mass_bound"] <= s["max_omitted_mass_bound"] <= 1


def test_a_tau_no_recall_can_meet_falls_back_to_exact_attention_over_every_token(models):
    """tau = 1e-9 is below the float32 rounding certificate of any exact read (resident codes, then exact resident
    entries, each with every page recalled): the head is then served by exact attention over all tokens (dense
    tokens, bytes_paged), after both tried."""
    model = models["qwen2"]
    ids = _ids(model, seed=4)
    ref = _decode(model, ids, DynamicCache(config=model.config))
    with resident_cache(model, "int8", "h2o", Gate.certified(1e-9), validate=True) as cache:
        assert torch.equal(_decode(model, ids, cache), ref)
        tel = cache.telemetry()
    rec = tel.recorded
    assert tel.bytes_paged > 0 and tel.violations == 0 and tel.recall_violations == 0
    assert bool((tel.served[rec] == 0).all())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["h2o", "streaming"])
def test_int8_sketch_summary_is_exact_at_tau_zero_and_counts_its_bytes(models, family, policy):
    model = models[family]
    ids = _ids(model, batch=2, seed=5)
    _tau_zero_identical(model, "int8", policy, "int8")
    with resident_cache(model, "int4", policy, Gate.certified(0.3), validate=True, summary="int8") as cache:
        _decode(model, ids, cache)
        tel = cache.telemetry()
    rec = tel.recorded
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0
    assert bool((tel.served[rec] <= 0.3).all())
    live = ~torch.isnan(tel.omitted_mass_bound)
    assert bool((tel.omitted_mass[live] <= tel.omitted_mass_bound[live]).all())
    omitted = PROMPT - (PROMPT - math.floor(0.75 * PROMPT + 1e-9))
    hkv, d = model.config.num_key_value_heads, 32
    per_layer = 2 * hkv * omitted * (d + 3 * 4) + 3 * 2 * hkv * 4  # batch 2: codes + 3 floats per token
    assert tel.bytes_summary == model.config.num_hidden_layers * per_layer


def test_resident_one_keeps_everything_and_reads_as_before(models):
    model = models["llama"]
    ids = _ids(model, seed=3)
    with CertifiedCache(
        model,
        keys="int8",
        values="int8",
        gate=Gate.certified(0.2),
        validate=True,
        eviction=EvictionConfig.resident_set(1.0),
    ) as cache:  # default select (SnapKV) and summary (int8)
        _decode(model, ids, cache)
        tel = cache.telemetry()
    assert tel.resident_fraction == 1.0 and tel.pages_recalled == 0 and tel.bytes_summary == 0
    assert tel.omitted_mass_bound is None and tel.violations == 0


def _resident(resident: object = 0.5, **kw) -> Callable[[], EvictionConfig]:
    return lambda: EvictionConfig.resident_set(resident, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "cache_kw", "match"),
    [
        (_resident(0.0), {}, "resident must be a fraction"),
        (_resident(-0.5), {}, "resident must be a fraction"),
        (_resident(1.5), {}, "resident must be a fraction"),
        (_resident(float("nan")), {}, "resident must be a fraction"),
        (_resident(True), {}, "resident must be a fraction"),
        (_resident("0.5"), {}, "resident must be a fraction"),
        (_resident(page_size=0), {}, "page_size"),
        (_resident(summary="int3"), {}, "summary must be one of"),
        (_resident(recall="sometimes"), {}, "recall must be one of"),
        (_resident(select="snapkv"), {}, "select must be a kvcert.evict.EvictionPolicy"),
        (lambda: EvictionConfig(H2O(recent=2), budget=8, resident=0.5), {}, "resident_set"),
        (lambda: EvictionConfig(H2O(recent=2), compression_ratio=0.25, resident=0.5), {}, "resident_set"),
        (_resident(), {"gate": Gate.certified(0.2, granularity="block")}, "head granularity"),
        (_resident(), {"gate": Gate.risk_ranked(5.0)}, "head granularity"),
        (_resident(), {"gate": Gate.certified(0.2, value_rel=0.1)}, "value_rel=0.1"),
        (_resident(), {"validation": ValidationConfig(certify=False)}, "certify=True"),
    ],
)
def test_bad_resident_arguments_raise_clear_errors(models, build, cache_kw, match):
    with pytest.raises(ValueError, match=match):
        CertifiedCache(models["llama"], keys="int8", values="int8", eviction=build(), **cache_kw)


def test_non_finite_layer_keeps_every_token_resident():
    from kvcert.quant import get

    store = LayerStore(0, get("int8"), get("int8"), bands=2, pairing="rotate_half", seed=0)
    k = torch.randn(1, 2, 5, 8)
    store.append(k, torch.randn(1, 2, 5, 8), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.bool))
    assert can_omit(store)
    k[0, 1, 3, 2] = float("nan")
    bad = LayerStore(0, get("int8"), get("int8"), bands=2, pairing="rotate_half", seed=0)
    bad.append(k, torch.randn(1, 2, 5, 8), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.bool))
    assert not can_omit(bad)


@torch.no_grad()
def _decode_padded(model, ids, mask, cache, steps=STEPS):
    out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
    toks = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(nxt)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(nxt, attention_mask=mask, cache=cache, use_cache=True)
    return torch.cat(toks, 1)


def test_left_padded_batch_masks_omitted_tokens_by_position(models):
    """Padding tokens may be omitted (their pages are summarised) but never count as visible: tau = 0 matches
    DynamicCache on a left-padded batch and validate mode stays at 0 violations."""
    model = models["llama"]
    ids = _ids(model, batch=2, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ref = _decode_padded(model, ids, mask, DynamicCache(config=model.config))
    with resident_cache(model, "int8", "streaming", Gate.certified(0.0)) as cache:
        assert torch.equal(_decode_padded(model, ids, mask, cache), ref)
    with resident_cache(model, "int8", "h2o", Gate.certified(0.3), validate=True) as cache:
        _decode_padded(model, ids, mask, cache)
        tel = cache.telemetry()
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0
    assert bool((tel.served[tel.recorded] <= 0.3).all())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_persistent_recall_pages_in_once_within_the_device_budget(models, family):
    """Persistent recall: 0 violations per cell, fewer recalled bytes than transient recall on the same run, the
    held pages counted in bytes_device, and bytes_device within device_budget x the context's fp16 K/V (up to the
    tokens the stores appended after the last forward's budget check: one per layer and KV head)."""
    model = models[family]
    ids = _ids(model, batch=2, seed=7)
    got = {}
    for recall in ("transient", "persistent"):
        with resident_cache(
            model, "int4", "streaming", Gate.certified(0.1), True, StorageConfig(device_budget=1.0), recall=recall
        ) as cache:
            _decode(model, ids, cache, steps=10)
            tel = cache.telemetry()
            stores = sum(layer.store.bytes_device() for layer in cache.layers)
        assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0
        assert bool((tel.served[tel.recorded] <= 0.1).all())
        assert tel.bytes_device == stores + tel.bytes_summary + tel.bytes_held
        got[recall] = tel
    assert got["transient"].bytes_held == 0 and got["persistent"].bytes_held > 0
    assert got["persistent"].bytes_recalled < got["transient"].bytes_recalled
    cfg = model.config
    slack = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 2 * 32 * 4  # one exact float32 token each
    assert got["persistent"].bytes_device <= 1.0 * got["persistent"].bytes_fp16_context + slack


def test_resident_codes_above_tau_are_read_exact_instead_of_dense(models):
    """int2 resident codes alone exceed tau = 0.05: the read serves the resident entries exact from the host tier
    plus recalled pages (resident entries paged in, no dense read of the whole context), 0 violations."""
    model = models["llama"]
    ids = _ids(model, batch=2, seed=8)
    with resident_cache(
        model, "int2", "streaming", Gate.certified(0.05), validate=True, resident=0.5, recall="transient"
    ) as cache:
        _decode(model, ids, cache)
        tel = cache.telemetry()
        recs = cache.resident_records
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0
    assert bool((tel.served[tel.recorded] <= 0.05).all())
    assert sum(r.bytes_exact for r in recs) > 0 and sum(r.bytes_dense for r in recs) == 0
    # the prefill (read before the resident set exists) may repair too: the resident reads' page-in is part of it
    assert tel.bytes_paged >= sum(r.bytes + r.bytes_exact + r.bytes_dense for r in recs) > 0


@pytest.mark.parametrize("summary", ["int8", "basis8"])
def test_a_summarys_key_estimate_is_decoded_once_and_is_the_sketchs_point_estimate(models, summary):
    """``OmittedPages.key_estimate`` (the decode scores' ranking) is computed once per summary object and equals the
    sketch's own point estimate, one per omitted token: the int8 sketch's scale times codes, the basis sketch's
    ``A·â + B·b̂``."""
    model = models["llama"]
    with resident_cache(model, "int4", "snapkv", Gate.certified(0.1), summary=summary) as cache:
        _decode(model, _ids(model, batch=2, seed=9), cache, steps=1)
        layer, pages = next(iter(cache._pages.items()))
        first = pages.key_estimate
        assert pages.key_estimate is first
        sk = pages.sketch
        want = sk.estimate() if summary == "basis8" else sk.codes.to(torch.float32) * sk.scale.unsqueeze(-1)
        assert torch.equal(first, want)
        assert first.shape == cache.layers[layer].store.evicted["k"].view().shape
