"""Eviction configuration of a cache: the named constructors, the resident set as prefill compression, and each
refusal named."""

from __future__ import annotations

import pytest

from kvcert.attention.evict_driver import EvictionConfig, default_select
from kvcert.cache.gate import Gate
from kvcert.evict import H2O, SnapKV, StreamingLLM
from kvcert.integrations.cache_config import StorageConfig

STORES = [StorageConfig("int8", "int8", seed=0).store(0)]
OK = {"sliding": False, "ladder": False, "validate": False, "gate": Gate.off(), "certify": True}


def test_named_constructors_build_what_they_say() -> None:
    policy = StreamingLLM(sinks=4, window=8)
    assert EvictionConfig.prefill(policy, 0.75) == EvictionConfig(policy, compression_ratio=0.75)
    assert EvictionConfig.decode_budget(policy, 16, chunk=2, belady=True) == EvictionConfig(
        policy, 16, chunk=2, belady=True
    )
    assert EvictionConfig() == EvictionConfig(None)  # no eviction
    EvictionConfig.decode_budget(policy, 16).check(STORES, **OK)  # fine


def test_a_resident_set_is_prefill_compression_by_its_select_policy() -> None:
    cfg = EvictionConfig.resident_set(0.25)
    assert isinstance(cfg.policy, SnapKV) and cfg.compression_ratio == 0.75 and cfg.resident == 0.25
    assert cfg.budget is None and cfg.resident_alloc == "uniform" and cfg.reselect is None
    assert isinstance(default_select(), SnapKV)
    own = StreamingLLM(sinks=2)
    assert EvictionConfig.resident_set(0.5, select=own).policy is own
    assert EvictionConfig.resident_set(1).resident == 1.0  # an int fraction is a float
    with pytest.raises(ValueError, match="resident_set"):
        EvictionConfig(own, compression_ratio=0.25, resident=0.5)  # inconsistent with the fraction
    with pytest.raises(ValueError, match="resident_set"):
        EvictionConfig(own, 8, resident=0.5)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: EvictionConfig(budget=16), "need a policy"),
        (lambda: EvictionConfig(H2O(recent=2)), "exactly one of budget"),
        (lambda: EvictionConfig.decode_budget(StreamingLLM(sinks=4, window=8), 3), "smaller than the policy's"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 16, chunk=20), "chunk must be an int"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 16, chunk=1.5), "chunk must be an int"),
        (lambda: EvictionConfig.prefill(H2O(recent=2), 1.0), "compression_ratio must be in"),
        (lambda: EvictionConfig(H2O(recent=2), compression_ratio=0.5, belady=True), "belady=True needs"),
        (lambda: EvictionConfig(belady=True), "belady=True needs"),
        (lambda: EvictionConfig.prefill(SnapKV, 0.5), "policy must be a kvcert.evict.EvictionPolicy"),
        (lambda: EvictionConfig.resident_set(None), "resident must be a fraction"),
        (lambda: EvictionConfig.resident_set(0.5, select=SnapKV), "select must be a kvcert.evict.EvictionPolicy"),
        (lambda: EvictionConfig.resident_set(0.5, page_size=0), "page_size"),
        (lambda: EvictionConfig.resident_set(0.5, reselect=0), "reselect must be a positive int"),
        (lambda: EvictionConfig.resident_set(0.5, reselect_score="x"), "reselect_score must be one of"),
        (lambda: EvictionConfig.resident_set(0.5, resident_alloc="x"), "resident_alloc must be one of"),
        (lambda: EvictionConfig(reselect=2), "reselect=N re-selects a resident set"),
        (lambda: EvictionConfig(resident_alloc="mass"), "resident_alloc splits a resident set"),
    ],
)
def test_each_construction_names_the_argument_at_fault(build, match) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_check_names_the_setting_that_the_cache_cannot_honour() -> None:
    budget = EvictionConfig.decode_budget(H2O(recent=2), 16)
    cases = [
        (EvictionConfig.decode_budget(H2O(recent=2), 16, belady=True), {}, "belady=True needs"),
        (budget, {"ladder": True}, "ladder=True"),
        (budget, {"sliding": True}, "sliding-window"),
        (EvictionConfig.resident_set(0.5), {"certify": False}, "needs certify=True"),
        (EvictionConfig.resident_set(0.5), {"gate": Gate.risk_ranked(2.0)}, "head granularity"),
    ]
    for cfg, over, message in cases:
        with pytest.raises(ValueError, match=message):
            cfg.check(STORES, **{**OK, **over})
    EvictionConfig.prefill(H2O(recent=2), 0.5).check(STORES, **{**OK, "sliding": True})  # prefill: served
    EvictionConfig.decode_budget(H2O(recent=2), 16, belady=True).check(STORES, **{**OK, "validate": True})
    with pytest.raises(ValueError, match="per-token codecs"):
        budget.check([StorageConfig("kivi-2", "int8", seed=0).store(0)], **OK)
    with pytest.raises(ValueError, match="dithered codec"):
        EvictionConfig.resident_set(0.5, reselect=2).check([StorageConfig("dither-int8", seed=0).store(0)], **OK)
