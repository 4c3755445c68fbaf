"""Eviction configuration of a cache: the resident set as prefill compression, and each refusal named."""

from __future__ import annotations

import pytest

from kvcert.attention.evict_driver import EvictionConfig, default_select
from kvcert.cache.gate import Gate
from kvcert.evict import SnapKV, StreamingLLM
from kvcert.integrations.cache_config import StorageConfig


def _of(**kw) -> EvictionConfig:
    args = {
        "evict": None,
        "budget": None,
        "compression_ratio": None,
        "chunk": 1,
        "belady": False,
        "resident": None,
        "select": None,
        "page_size": 16,
        "summary": "int8",
        "gate": Gate.off(),
        "certify": True,
    }
    return EvictionConfig.of(**{**args, **kw})


def test_a_resident_set_is_prefill_compression_by_its_select_policy() -> None:
    cfg = _of(resident=0.25)
    assert isinstance(cfg.policy, SnapKV) and cfg.compression_ratio == 0.75 and cfg.resident == 0.25
    assert isinstance(default_select(), SnapKV)
    own = StreamingLLM(sinks=2)
    assert _of(resident=0.5, select=own).policy is own
    with pytest.raises(ValueError, match="select=<policy> needs resident"):
        _of(select=own)
    with pytest.raises(ValueError, match="do not pass evict, budget or compression_ratio"):
        _of(resident=0.5, budget=8)


def test_check_names_the_setting_that_cannot_be_honoured() -> None:
    stores = [StorageConfig("int8", "int8").store(0)]
    policy = StreamingLLM(sinks=4, window=8)
    _of(evict=policy, budget=16).check(stores, sliding=False, ladder=False, validate=False)  # fine
    cases = [
        (_of(budget=16), {}, "need evict=<EvictionPolicy>"),
        (_of(evict=policy), {}, "exactly one of budget"),
        (_of(evict=policy, budget=3), {}, "smaller than the policy's protected items"),
        (_of(evict=policy, budget=16, chunk=20), {}, "evict_chunk must be an int"),
        (_of(evict=policy, budget=16, belady=True), {}, "belady=True needs"),
        (_of(evict=policy, compression_ratio=1.0), {}, "compression_ratio must be in"),
        (_of(evict=policy, budget=16), {"ladder": True}, "ladder=True"),
        (_of(evict=policy, budget=16), {"sliding": True}, "sliding-window"),
    ]
    for cfg, over, message in cases:
        kw = {"sliding": False, "ladder": False, "validate": False, **over}
        with pytest.raises(ValueError, match=message):
            cfg.check(stores, **kw)
    with pytest.raises(ValueError, match="per-token codecs"):
        _of(evict=policy, budget=16).check([StorageConfig("kivi-2", "int8").store(0)], False, False, False)
