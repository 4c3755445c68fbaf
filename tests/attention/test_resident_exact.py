"""A resident read whose codes alone exceed tau reads exact only the resident blocks it needs: per-cell soundness,
bytes_exact equal to the entries read, fewer bytes than the whole resident set, tau = 0 identical to DynamicCache."""

from __future__ import annotations

import pytest
import torch
from resident_cases import POLICIES, assert_sound_in_every_cell, greedy_decode, prompt_ids
from transformers import DynamicCache

import kvcert.attention.resident as resident
from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 6
#: below what the resident codes certify on these heads (about 4e-4 for int8, 6e-3 for int4): codes_above is forced
TAUS = {"int8": 2e-4, "int4": 3e-3}


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=32) for family in ("llama", "qwen2")}


def _cache(model, keys: str, tau: float, block: int, policy: str = "snapkv") -> CertifiedCache:
    return CertifiedCache(
        model,
        gate=Gate.certified(tau, block_size=block),
        validate=tau > 0,
        storage=StorageConfig(keys=keys, values="int8"),
        eviction=EvictionConfig.resident_set(0.5, select=POLICIES[policy](), page_size=4, recall="transient"),
    )


def _exact_reads(monkeypatch) -> list[tuple[int, int]]:
    """Record ``(visit, slots read exact)`` of every :func:`_exact_resident` call; ``visit`` identifies the head visit
    (the codes object it starts from; kept alive so identities are not reused)."""
    calls: list[tuple[int, int]] = []
    keep: list[object] = []
    inner = resident._exact_resident

    def spy(ov, keys, values, mask, bi, hi, slots, slots_host, served):
        assert slots.tolist() == list(slots_host)  # the slots on the device and as read back agree
        keep.append(served)
        calls.append((id(served), len(slots_host)))
        return inner(ov, keys, values, mask, bi, hi, slots, slots_host, served)

    monkeypatch.setattr(resident, "_exact_resident", spy)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("keys", "policy"), [("int8", "snapkv"), ("int8", "h2o"), ("int4", "streaming")])
def test_exact_blocks_are_sound_per_cell_and_bytes_exact_counts_the_entries_read(
    models, monkeypatch, family, keys, policy
):
    """Codes above tau (int8 / int4 keys, ``TAUS``), blocks of 4 resident slots: every cell's true TV <= its
    certificate and <= tau, output and omitted-mass bounds hold, and ``bytes_exact`` is the slots of the blocks each
    served head read exact (the last, largest try of each head: tries nest) times the bytes of one K/V entry."""
    model = models[family]
    calls = _exact_reads(monkeypatch)
    tau = TAUS[keys]
    with _cache(model, keys, tau, 4, policy) as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=16), cache, STEPS)
        tel = cache.telemetry()
        recs = cache.resident_records
        host = cache.layers[0].store.k.host
    assert_sound_in_every_cell(tel)
    assert bool((tel.served[tel.recorded] <= tau).all())
    assert sum(r.bytes_dense for r in recs) == 0  # every head read exact is served by it (no dense read)
    last: dict[int, int] = {}
    for visit, n in calls:
        last[visit] = max(last.get(visit, 0), n)
    entry = 2 * 32 * host.dtype.itemsize  # one resident K + V entry (head_dim 32) in the host tier
    total = sum(r.bytes_exact for r in recs)
    assert total > 0 and total == sum(last.values()) * entry


def test_one_block_certifies_with_fewer_bytes_than_the_whole_resident_set(models, monkeypatch):
    """With blocks of 4 some head certifies from its first block(s) alone: it reads fewer slots than its resident set
    and the run pages fewer exact bytes than the same run with one block per head (the whole resident set), both
    certifying every cell at tau."""
    model = models["llama"]
    ids = prompt_ids(model, batch=2, seed=16)
    calls = _exact_reads(monkeypatch)
    got = {}
    for block in (4, 4096):
        calls.clear()
        with _cache(model, "int8", TAUS["int8"], block) as cache:
            greedy_decode(model, ids, cache, STEPS)
            tel = cache.telemetry()
            got[block] = sum(r.bytes_exact for r in cache.resident_records)
            s_r = min(layer.store.k.served.shape[2] for layer in cache.layers)
        assert tel.violations == 0 and tel.recall_violations == 0
        assert bool((tel.served[tel.recorded] <= TAUS["int8"]).all())
        if block == 4:
            assert min(n for _, n in calls) < s_r
    assert 0 < got[4] < got[4096]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tau_zero_with_small_exact_blocks_is_token_identical_to_dynamic_cache(models, family):
    model = models[family]
    ids = prompt_ids(model, batch=2, seed=16)
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), STEPS)
    with _cache(model, "int8", 0.0, 4) as cache:
        assert torch.equal(greedy_decode(model, ids, cache, STEPS), ref)
