"""Resident sets on a model with sliding-window layers (a tiny Gemma-3: sliding and full-attention layers, prompts
longer than the window): the full-attention layers keep the resident set, the sliding ones their window; per-cell
soundness, exactness at tau = 0, the device budget, the per-layer split and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from resident_cases import POLICIES, assert_sound_in_every_cell, greedy_decode, prompt_ids
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.attention.evict_driver import ingest_reads
from kvcert.cli.ruler_report import resident_numbers, resident_table
from kvcert.eval.branching import exact_prefill, greedy_from
from kvcert.evict import H2O, SnapKV
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 6
WINDOW = 16  # below the 40-token prompts, above one write block: the sliding layers trim and are compressed
SLIDING = (0, 1, 3, 4)  # of the six layers (5 local : 1 global in Gemma-3 itself, here 2 : 1)


@pytest.fixture(scope="module")
def model():
    return tiny_random("gemma3", num_hidden_layers=6, head_dim=32, num_key_value_heads=2, sliding_window=WINDOW)


def _cache(
    model,
    tau: float = 0.2,
    codec: str = "int4",
    resident: float = 0.25,
    validate: bool = False,
    device_budget: float | None = 1.0,
    **kw,
) -> CertifiedCache:
    return CertifiedCache(
        model,
        gate=Gate.certified(tau),
        validate=validate,
        storage=StorageConfig(keys=codec, values="int4", write_block=4, device_budget=device_budget),
        eviction=EvictionConfig.resident_set(
            resident, select=kw.pop("select", POLICIES["snapkv"]()), page_size=4, **kw
        ),
    )


def test_the_tiny_model_mixes_sliding_and_full_layers(model):
    types = model.config.layer_types
    assert tuple(i for i, t in enumerate(types) if t == "sliding_attention") == SLIDING
    assert model.config.sliding_window == WINDOW


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "streaming"])
def test_tau_zero_is_token_identical_to_dynamic_cache(model, policy):
    ids = prompt_ids(model, batch=2)
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), STEPS)
    with _cache(model, tau=0.0, select=POLICIES[policy]()) as cache:
        assert torch.equal(greedy_decode(model, ids, cache, STEPS), ref)
        assert cache.uncompressed_layers == ()  # the sliding layers are compressed and certified too
        assert set(cache._pages) == {2, 5}  # only the full-attention layers omit tokens


@pytest.mark.parametrize("tau", [0.05, 0.2])
def test_validate_mode_is_sound_in_every_cell_of_sliding_and_full_layers(model, tau):
    """Every cell's certificate holds against the exact attention its layer computes: over every token (resident
    and omitted) on a full-attention layer, over the window on a sliding one; sliding layers hold their window only
    and are read (cells recorded), with no omitted-mass reading; the full layers keep about the resident fraction."""
    ids = prompt_ids(model, batch=2, seed=3)
    with _cache(model, tau=tau, validate=True) as cache:
        greedy_decode(model, ids, cache, STEPS)
        tel = cache.telemetry()
        held = [layer.store.n for layer in cache.layers]
    assert_sound_in_every_cell(tel)
    assert bool((tel.served[tel.recorded] <= tau).all())
    assert all(held[i] <= WINDOW for i in SLIDING)
    for i in range(6):
        read = bool(tel.recorded[:, i].any())
        assert read  # every layer, sliding or not, is read through a certificate
        assert bool(torch.isnan(tel.omitted_mass_bound[:, i]).all()) == (i in SLIDING)
    fractions = tel.layer_resident_fractions
    assert fractions is not None and all(math.isnan(fractions[i]) == (i in SLIDING) for i in range(6))
    assert tel.resident_fraction == pytest.approx(fractions[2]) and 0.25 <= tel.resident_fraction < 0.5
    summary = tel.summary()
    assert summary["min_layer_resident_fraction"] == pytest.approx(tel.resident_fraction)


def test_the_device_budget_holds_at_every_step(model):
    """After every forward the device bytes (stores of every layer, summaries, held pages) stay within the budget times
    the fp16 K/V a ``DynamicCache`` holds (every written token of a full layer, the window of a sliding one), up to
    the tokens the layers wrote after the forward's budget check; telemetry's ``bytes_fp16_context`` is that
    denominator and the budget binds (held pages fill it)."""
    cfg = model.config
    budget = 0.8
    slack = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 2 * 32 * 4
    over: list[int] = []
    ratio: list[float] = []

    def fp16(cache) -> int:
        stores = [layer.store for layer in cache.layers]
        omitted = sum(2 * (s.evicted["k"].view().numel() + s.evicted["v"].view().numel()) for s in stores if s.evicted)
        return sum(s.bytes_fp16() for s in stores) + omitted

    def check(cache) -> None:
        device = sum(layer.store.bytes_device() for layer in cache.layers)
        device += sum(p.nbytes for p in cache._pages.values())
        over.append(device - int(budget * fp16(cache) + slack))
        ratio.append(device / fp16(cache))

    with _cache(model, tau=0.1, select=H2O(recent=3), device_budget=budget, codec="int4") as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=7), cache, STEPS, each=check)
        tel = cache.telemetry()
        assert tel.bytes_fp16_context == fp16(cache)
    assert max(over) <= 0 and tel.bytes_held > 0
    assert max(ratio) >= 0.97 * budget


def test_the_sliding_windows_device_bytes_bound_the_capacity(model):
    """``bytes_device_sliding`` is the sliding layers' share of ``bytes_device`` (their stores: codes, scales,
    witnesses; no summary or held page is theirs), so ``bytes_fp16_context / bytes_device_sliding`` bounds the
    capacity from above; the resident table reports that ceiling next to the capacity."""
    with _cache(model, tau=0.2, codec="int8", device_budget=None) as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=23), cache, STEPS)
        tel = cache.telemetry()
        sliding = sum(cache.layers[i].store.bytes_device() for i in SLIDING)
        full = sum(cache.layers[i].store.bytes_device() for i in (2, 5))
    assert tel.bytes_device_sliding == sliding > 0
    assert tel.bytes_device == sliding + full + tel.bytes_summary + tel.bytes_held
    assert tel.summary()["bytes_device_sliding"] == sliding
    ceiling = tel.bytes_fp16_context / sliding
    assert tel.bytes_fp16_context / tel.bytes_device < ceiling
    numbers = resident_numbers([tel, tel])  # two samples: the bytes add up, the ceiling is their ratio
    assert numbers["bytes_device_sliding"] == {"value": 2 * sliding, "tier": "empirical"}
    table = resident_table({"variants": {"int8+resident": {"gate": tel.gate, **numbers}}})
    assert table is not None
    (row,) = table.rows
    assert row[table.columns.index("ceiling")] == f"{ceiling:.3g}"


def test_mass_allocation_splits_over_the_full_layers_only(model):
    """``resident_alloc="mass"`` keeps the uniform setting's total over the full-attention layers, split between
    them; the sliding layers take no share."""
    ids = prompt_ids(model, batch=1, seed=5)
    kept = {}
    for alloc in ("uniform", "mass"):
        with _cache(model, tau=0.2, resident_alloc=alloc, validate=True) as cache:
            greedy_decode(model, ids, cache, 1)
            tel = cache.telemetry()
            kept[alloc] = sum(cache.layers[i].store.n for i in (2, 5))
            assert tel.recall_violations == 0 and tel.violations == 0
            assert all(math.isnan(tel.layer_resident_fractions[i]) for i in SLIDING)
            if alloc == "mass":
                assert set(cache._evictor.layer_ratio) == {2, 5}
    assert kept["mass"] == kept["uniform"]


def test_reselection_on_a_sliding_model_is_sound(model):
    ids = prompt_ids(model, batch=2, seed=11)
    with _cache(model, tau=0.2, codec="int8", reselect=2, validate=True) as cache:
        greedy_decode(model, ids, cache, STEPS)
        tel = cache.telemetry()
    assert tel.reselect is not None and tel.reselect.reselections == 2 * 3  # layers 2 and 5 at steps 2, 4, 6
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("summary", ["basis8", "basis8-qspec"])
def test_swap_recall_on_a_sliding_model_is_sound(model, codec, summary):
    """``recall="swap"`` (the SmolLM2 3x configuration: fp16 or int8 resident keys, basis8 summaries, principal or
    query-aware basis) swaps in the resident set of the full-attention layers with 0 violations in every cell, 0
    output and 0 recall violations; the sliding layers still hold only their window."""
    ids = prompt_ids(model, batch=2, seed=19)
    with _cache(model, tau=0.1, codec=codec, summary=summary, recall="swap", validate=True) as cache:
        greedy_decode(model, ids, cache, STEPS)
        tel = cache.telemetry()
        held = [layer.store.n for layer in cache.layers]
    assert_sound_in_every_cell(tel)
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0
    assert tel.reselect is not None and tel.reselect.promoted > 0  # the swaps happened
    assert all(held[i] <= WINDOW for i in SLIDING)


@pytest.mark.parametrize("recorded", [False, True])
def test_an_ingested_prefill_at_tau_zero_decodes_the_dense_tokens(model, recorded):
    """The branching path of the benchmarks: a ``DynamicCache`` prefill (its sliding layers hold their window) is
    ingested into a resident cache, with the key-proxy scores or with the attention recorded in the prefill forward
    (what ``run_branches`` passes); at tau = 0 it decodes the dense tokens."""
    ids = prompt_ids(model, batch=1, seed=13)
    select = POLICIES["snapkv"]()
    pre = exact_prefill(model, ids, reads=ingest_reads(select) if recorded else None)
    dense = greedy_from(model, pre.first, exact_prefill(model, ids).cache, STEPS, [])
    with _cache(model, tau=0.0, select=select) as cache:
        cache.ingest(pre.cache, pre.attentions)
        assert greedy_from(model, pre.first, cache, STEPS, []) == dense
        assert set(cache._pages) == {2, 5}


def test_prefill_compression_applies_to_the_full_layers(model):
    """``evict=..., compression_ratio=r`` falls out the same way: the full layers keep ``1 − r`` of the prompt, the
    sliding layers their window, and the exact evicted mass is recorded for the full layers only."""
    ids = prompt_ids(model, batch=1, seed=17)
    with CertifiedCache(
        model,
        validate=True,
        storage=StorageConfig(keys="int8", values="int8", write_block=4),
        eviction=EvictionConfig.prefill(SnapKV(window=3, kernel=3), 0.5),
    ) as cache:
        greedy_decode(model, ids, cache, 2)
        tel = cache.telemetry()
        held = [layer.store.n for layer in cache.layers]
    assert held[2] == held[5] == 20 + 2
    assert all(held[i] <= WINDOW for i in SLIDING)
    assert tel.evicted_mass is not None
    for i in range(6):
        assert bool(torch.isnan(tel.evicted_mass[:, i]).all()) == (i in SLIDING)


def test_what_cannot_be_served_is_refused():
    gemma = tiny_random("gemma3", sliding_window=WINDOW)
    with pytest.raises(ValueError, match="decode-time eviction \\(EvictionConfig.decode_budget\\) is not supported"):
        CertifiedCache(
            gemma,
            storage=StorageConfig(keys="int8", values="int8", write_block=4),
            eviction=EvictionConfig.decode_budget(H2O(recent=2), 8),
        )
    every_layer_sliding = tiny_random("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="no full-attention layer"):
        CertifiedCache(
            every_layer_sliding,
            gate=Gate.certified(0.2),
            storage=StorageConfig(keys="int8", values="int8", write_block=4),
            eviction=EvictionConfig.resident_set(0.25),
        )
