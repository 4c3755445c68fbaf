"""Per-layer allocation of a resident set (``EvictionConfig.resident_set(R, resident_alloc="mass")``): the uniform
total split across layers, protected tokens in every layer, per-cell soundness, exactness at tau = 0, re-selection at
each layer's own fraction, a layer that keeps every token, clear errors."""

from __future__ import annotations

import pytest
import torch
from resident_cases import POLICIES, PROMPT, assert_sound_in_every_cell, greedy_decode, resident_cache, validated_runs
from resident_cases import prompt_ids as _ids
from transformers import DynamicCache

import kvcert.attention.evict_driver as evict_driver
from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.evict import SnapKV, StreamingLLM
from kvcert.evict.base import prefill_kept_count
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 6
LAYERS = 4
#: the policies whose prefill scores are attention (resident_alloc="mass" refuses StreamingLLM)
MASS_POLICIES = sorted(set(POLICIES) - {"streaming"})


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=32, num_hidden_layers=LAYERS) for family in ("llama", "qwen2")}


def _prefill_sizes(model, ids, resident: float, **kw) -> list[int]:
    """Resident tokens per (row, KV head) of every layer right after the prefill of ``ids``."""
    resident_set = EvictionConfig.resident_set(resident, page_size=4, **kw)
    with CertifiedCache(model, keys="int8", values="int8", eviction=resident_set) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        return [layer.store.n for layer in cache.layers]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("resident", [0.25, 0.5])
def test_mass_keeps_the_uniform_total_and_the_protected_tokens_of_every_layer(models, family, resident):
    model = models[family]
    ids = _ids(model, batch=2, seed=3)
    uniform = _prefill_sizes(model, ids, resident, select=SnapKV(window=3, kernel=3))
    mass = _prefill_sizes(model, ids, resident, select=SnapKV(window=3, kernel=3), resident_alloc="mass")
    assert uniform == [prefill_kept_count(PROMPT, 1.0 - resident)] * LAYERS
    assert sum(mass) == sum(uniform) and all(3 <= n <= PROMPT for n in mass)
    assert mass != uniform  # random layers differ in how concentrated their attention is


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", MASS_POLICIES)
def test_tau_zero_with_mass_is_token_identical_to_dynamic_cache(models, family, policy):
    model = models[family]
    ids = _ids(model, batch=2)
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), STEPS)
    with resident_cache(model, "int4", policy, Gate.certified(0.0), resident_alloc="mass") as cache:
        assert torch.equal(greedy_decode(model, ids, cache, STEPS), ref)
        assert cache.telemetry().resident_fraction < 1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", MASS_POLICIES)
@pytest.mark.parametrize(("codec", "summary"), [("none", "int8"), ("int4", "basis8"), ("int8", "box")])
def test_validate_mode_zero_violations_in_every_cell_with_mass(models, family, policy, codec, summary):
    model = models[family]
    ids = _ids(model, batch=2, seed=1)
    runs = validated_runs(
        model, ids, codec, policy, STEPS, StorageConfig(device_budget=0.5), summary=summary, resident_alloc="mass"
    )
    assert len(list(runs)) == 2  # each run checked per cell, the gated one at most TAU in every served cell


def test_telemetry_reports_each_layers_resident_fraction(models):
    model = models["llama"]
    ids = _ids(model, seed=2)
    with resident_cache(model, "int8", "snapkv", None, resident_alloc="mass") as cache:
        greedy_decode(model, ids, cache, STEPS)
        tel = cache.telemetry()
        held = [layer.store.n for layer in cache.layers]
    total = PROMPT + STEPS
    assert tel.layer_resident_fractions == pytest.approx([n / total for n in held])
    assert tel.resident_fraction == pytest.approx(sum(held) / (LAYERS * total))
    s = tel.summary()
    assert s["min_layer_resident_fraction"] == min(tel.layer_resident_fractions) < tel.resident_fraction
    assert s["max_layer_resident_fraction"] == max(tel.layer_resident_fractions) > tel.resident_fraction


def test_ingest_splits_after_the_last_layer(models):
    """The branching path (:meth:`CertifiedCache.ingest` of an exact prefill) splits like a prefill through the
    cache (here with the key-proxy attention: the same total)."""
    model = models["llama"]
    ids = _ids(model, seed=4)
    pre = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=pre, use_cache=True)
    with CertifiedCache(
        model,
        keys="int8",
        values="int8",
        eviction=EvictionConfig.resident_set(0.25, select=SnapKV(window=3, kernel=3), resident_alloc="mass"),
    ) as cache:
        cache.ingest(pre)
        sizes = [layer.store.n for layer in cache.layers]
    assert sum(sizes) == LAYERS * prefill_kept_count(PROMPT, 0.75) and all(n >= 3 for n in sizes)


def test_reselect_keeps_each_layers_own_fraction(models):
    """Right after a re-selection over ``T`` tokens each layer holds ``prefill_kept_count(T, 1 − C_l / S)``, its
    allocated fraction of the prompt's ``S`` tokens (then this step's token)."""
    model = models["llama"]
    ids = _ids(model, seed=2)
    sizes = []
    with resident_cache(
        model, "int8", "snapkv", Gate.certified(0.3), reselect=3, reselect_score="key_proxy", resident_alloc="mass"
    ) as cache:
        greedy_decode(model, ids, cache, STEPS, each=lambda c: sizes.append([layer.store.n for layer in c.layers]))
        ratios = dict(cache._evictor.layer_ratio)
    assert len(ratios) == LAYERS and len(set(ratios.values())) > 1
    for step in (3, 6):
        want = [prefill_kept_count(PROMPT + step - 1, ratios[layer]) + 1 for layer in range(LAYERS)]
        assert sizes[step - 1] == want


def test_a_layer_that_keeps_every_token_reads_plainly_beside_resident_ones(models, monkeypatch):
    """A split that gives layer 0 all its tokens: no omitted pages there, the other layers take the rest; persistent
    recall under a device budget sizes its pool over every layer (one without omitted tokens too); sound per cell."""
    real = evict_driver.allocate_kept

    def layer0_full(scores, protected, total):
        rest = real(scores[1:], protected[1:], total - scores[0].shape[-1])
        return [scores[0].shape[-1], *rest]

    monkeypatch.setattr(evict_driver, "allocate_kept", layer0_full)
    model = models["qwen2"]
    with resident_cache(
        model,
        "int4",
        "snapkv",
        Gate.certified(0.1),
        True,
        StorageConfig(device_budget=0.5),
        resident=0.4,
        recall="persistent",
        resident_alloc="mass",
    ) as cache:
        greedy_decode(model, _ids(model, batch=2, seed=7), cache, STEPS)
        tel = cache.telemetry()
        assert 0 not in cache._pages and all(layer in cache._pages for layer in range(1, LAYERS))
    assert tel.layer_resident_fractions[0] == 1.0
    assert_sound_in_every_cell(tel)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: EvictionConfig.resident_set(0.5, resident_alloc="greedy"),
            "resident_alloc must be one of uniform, mass",
        ),
        (lambda: EvictionConfig(resident_alloc="mass"), "resident_alloc splits a resident set"),
        (
            lambda: EvictionConfig.resident_set(0.5, select=StreamingLLM(sinks=2), resident_alloc="mass"),
            "resident_alloc='mass'",
        ),
    ],
)
def test_bad_resident_alloc_raises_naming_the_argument(models, build, match):
    with pytest.raises(ValueError, match=match):
        CertifiedCache(models["llama"], keys="int8", values="int8", eviction=build())
