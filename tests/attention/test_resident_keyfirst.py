"""Key-first recall in the resident read (``kvcert.attention.key_recall``): per-cell soundness in validate mode with
pages kept key-only, exact and quantized resident storage, transient and persistent recall; τ = 0 exactness; key and
value page-in counted apart; fewer bytes than paging in K and V of the same pages; the keys paged in are those of the
K+V rule's pages and the values a subset; a planted bug caught."""

from __future__ import annotations

import pytest
import torch
from resident_cases import greedy_decode, prompt_ids, resident_cache, validated_runs
from transformers import DynamicCache

from kvcert import Gate
from kvcert.attention import key_recall, resident
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 6
D = 32  # head dim of the tiny models (keys and values)
HOST = 4  # the host tier's bytes per entry (float32 on CPU)


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=D) for family in ("llama", "qwen2")}


def _check_bytes(tel, records) -> None:
    """Key and value page-in counted apart, summing to the recall's page-in, per read and over the run, and fewer
    bytes than K and V of every page whose keys were paged in (some stayed key-only)."""
    assert tel.bytes_recalled == tel.bytes_recalled_keys + tel.bytes_recalled_values > 0
    s = tel.summary()
    assert s["bytes_recalled"] == s["bytes_recalled_keys"] + s["bytes_recalled_values"]
    for r in records:
        assert r.bytes == r.bytes_keys + r.bytes_values
        assert r.bytes_values <= r.bytes_keys  # values of a subset of the keyed pages (D_k = D_v)
    assert sum(r.bytes_keys for r in records) == tel.bytes_recalled_keys
    assert tel.bytes_recalled < tel.bytes_recalled_keys * 2  # K+V of the same pages: 2x the keys' bytes


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("codec", ["none", "int4"])
@pytest.mark.parametrize("recall", ["transient", "persistent"])
def test_key_first_recall_is_sound_in_every_cell(models, family, codec, recall):
    """Validate mode (pre- and post-recall certificates, the omitted-mass bound before recall and of what recall left
    omitted, the output bound): 0 violations per cell, with some recalled pages served key-only."""
    model = models[family]
    ids = prompt_ids(model, batch=2, seed=11)
    for gate, tel in validated_runs(model, ids, codec, "snapkv", STEPS, summary="basis8", recall=recall):
        if gate.mode == "certified":
            assert 0 < tel.bytes_recalled_values < tel.bytes_recalled_keys  # some keyed pages stayed key-only


@pytest.mark.parametrize("recall", ["transient", "persistent"])
def test_key_and_value_bytes_are_counted_apart_and_below_kv_recall_of_the_same_pages(models, recall):
    model = models["llama"]
    with resident_cache(model, "int4", "h2o", Gate.certified(0.1), summary="basis8", recall=recall) as cache:
        greedy_decode(model, prompt_ids(model, n=48, batch=2, seed=12), cache, STEPS)
        tel, records = cache.telemetry(), cache.resident_records
    _check_bytes(tel, records)
    # 36 omitted tokens, whole pages of 4: every keyed page pays 4 keys of D float32 entries
    assert tel.bytes_recalled_keys == tel.pages_recalled * 4 * D * HOST
    assert tel.bytes_recalled_values % (4 * D * HOST) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("recall", ["transient", "persistent"])
def test_tau_zero_is_token_identical_to_dynamic_cache(models, family, recall):
    model = models[family]
    ids = prompt_ids(model, batch=2, seed=13)
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), STEPS)
    with resident_cache(model, "int4", "snapkv", Gate.certified(0.0), summary="basis8", recall=recall) as cache:
        assert torch.equal(greedy_decode(model, ids, cache, STEPS), ref)


def test_dropping_the_key_only_pages_from_the_bound_is_caught(models, monkeypatch):
    """The planted bug: a read that forgets the key-only pages (they count for nothing in the bound, as if served)
    certifies masses it does not serve; validate mode reports violations."""
    real = key_recall.key_page_bound

    def forgetful(logits, radius, visible, page_size):
        u, seen = real(logits, radius, visible, page_size)
        return u, torch.zeros_like(seen)

    monkeypatch.setattr(key_recall, "key_page_bound", forgetful)
    model = models["llama"]
    with resident_cache(model, "none", "snapkv", Gate.certified(0.1), summary="basis8", validate=True) as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=11), cache, STEPS)
        tel = cache.telemetry()
    assert tel.recall_violations > 0


def test_keys_are_those_of_the_kv_rule_and_values_a_subset(models, monkeypatch):
    """Every recall pages in the keys of exactly the pages the K+V rule would recall at the same page count — the
    first ``k`` of the recall order after the held ones, ``k`` the caller's first guess doubled (capped at every
    page) — and the values of a subset of them; held pages are served, never paged in."""
    calls = []
    real = resident.grow_recall

    def spy(ov, bi, hi, order, order_host, k, n_held, l_res, c_res):
        assert order_host == order.tolist()  # the recall order as read back
        r = yield from real(ov, bi, hi, order, order_host, k, n_held, l_res, c_res)
        calls.append((order, k, n_held, r))
        return r

    monkeypatch.setattr(resident, "grow_recall", spy)
    model = models["qwen2"]
    with resident_cache(model, "int4", "h2o", Gate.certified(0.1), summary="basis8", recall="persistent") as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=14), cache, STEPS)
    assert calls and any(r.ok and r.pages.numel() > n for _, _, n, r in calls)
    assert any(r.keyed.numel() > r.pages.numel() - n for _, _, n, r in calls)  # some page stayed key-only
    for order, k, n_held, r in calls:
        n_pages, total = order.numel(), n_held + r.keyed.numel()
        counts = {min(max(k, n_held) * 2**i, n_pages) for i in range(n_pages.bit_length() + 1)} | {n_held}
        assert total in counts
        assert torch.equal(r.keyed, order[n_held:total])
        assert torch.equal(r.pages[:n_held], order[:n_held])
        served = r.pages[n_held:]
        assert bool(torch.isin(served, r.keyed).all()) and served.unique().numel() == served.numel()
