"""Swapping recalled pages into the resident set (``EvictionConfig.resident_set(R, recall="swap")``): exactness at
tau = 0, per-cell soundness in validate mode, the device budget, no page-in for what a swap promotes, a token needed
at two consecutive reads paged in once, bad arguments."""

from __future__ import annotations

import pytest
import torch
from resident_cases import greedy_decode, prompt_ids, resident_cache, validated_runs
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.attention.resident import fresh_by_position, held_by_position
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 7
D = 32  # head_dim of the tiny models


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=D) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_tau_zero_with_swap_is_token_identical_to_dynamic_cache(models, family, policy):
    model = models[family]
    ids = prompt_ids(model, batch=2)
    ref = greedy_decode(model, ids, DynamicCache(config=model.config), STEPS)
    with resident_cache(model, "int4", policy, Gate.certified(0.0), recall="swap") as cache:
        assert torch.equal(greedy_decode(model, ids, cache, STEPS), ref)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
@pytest.mark.parametrize(
    ("codec", "summary"),
    [("int4", "int8"), ("none", "int8"), ("int4", "basis8"), ("int4", "basis8-spec"), ("int8", "box")],
)
@pytest.mark.parametrize("budget", [None, 0.6])
def test_validate_mode_zero_violations_in_every_cell_with_swap(models, family, policy, codec, summary, budget):
    """Every (step, layer, row, query head) cell: true TV <= certificate, exact omitted mass <= its bound, with the
    recalled pages swapped into the resident set after every decode read (quantized and exact resident storage, int8,
    basis8 and box summaries, with and without a binding device budget); the gated run swaps."""
    model = models[family]
    ids = prompt_ids(model, batch=2, seed=1)
    storage = StorageConfig(device_budget=budget)
    for gate, tel in validated_runs(model, ids, codec, policy, STEPS, storage, summary=summary, recall="swap"):
        assert tel.reselect is not None
        if gate.mode == "certified":
            assert tel.reselect.promoted > 0 and tel.reselect.demoted > 0


@pytest.mark.parametrize("budget", [0.5, 0.7])
def test_bytes_device_never_exceeds_the_device_budget_with_swap(models, budget):
    """After every decode step: bytes_device (stores + summaries + held pages) within device_budget x the context's
    fp16 K/V, up to the tokens the later layers appended after the forward's budget check (the persistent-recall
    contract of ``tests/attention/test_resident.py``: one exact float32 token per layer, row and KV head)."""
    model = models["qwen2"]
    ids = prompt_ids(model, batch=2, seed=3)
    cfg = model.config
    slack = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 2 * D * 4

    def check(cache):
        tel = cache.telemetry()
        stores = sum(layer.store.bytes_device() for layer in cache.layers)
        assert tel.bytes_device == stores + tel.bytes_summary + tel.bytes_held
        assert tel.bytes_device <= budget * tel.bytes_fp16_context + slack

    storage = StorageConfig(device_budget=budget)
    with resident_cache(model, "int4", "snapkv", Gate.certified(0.05), storage=storage, recall="swap") as cache:
        greedy_decode(model, ids, cache, STEPS, check)
        assert cache.reselect_stats is not None and cache.reselect_stats.promoted > 0


def _paged_in(models, recall: str, budget: float) -> tuple[list[dict], object]:
    """Decode through a gated resident cache (``recall``) and record, at every swap point (right after each decode read
    of each resident layer, before the swap), the tokens by logical position ``[B, Hkv, T]`` whose values that read
    paged in (not held before it), those held, the resident ones; and, after the swap, the resident ones again and
    the swap's page-in bytes. ``recall="persistent"`` records the same through a swap that moves nothing."""
    model = models["llama"]
    ids = prompt_ids(model, batch=2, seed=6)
    steps: list[dict] = []
    storage = StorageConfig(device_budget=budget)
    with resident_cache(model, "int4", "snapkv", Gate.certified(0.1), storage=storage, recall="swap") as cache:
        evictor = cache._evictor
        swap = evictor.swap

        def recorded(store):
            pages = evictor.pages[store.layer]
            archive, length = store.evicted["positions"].view(), store.appended
            held, _ = held_by_position(pages, archive, length)
            fresh = fresh_by_position(pages, archive, length)
            resident = torch.zeros_like(held).scatter(-1, store.positions.view(), True)
            paged0 = evictor.reselect_stats.bytes_paged
            if recall == "swap":
                swap(store)
            else:  # what persistent recall would keep: the fresh marks reset as a new read begins
                pages.held.fresh.zero_()
            after = torch.zeros_like(held).scatter(-1, store.positions.view(), True)
            new_held, _ = held_by_position(evictor.pages[store.layer], store.evicted["positions"].view(), length)
            steps.append(
                {
                    "layer": store.layer,
                    "fresh": fresh,
                    "held": held,
                    "resident": resident,
                    "after": after,
                    "new_held": new_held,
                    "paged": evictor.reselect_stats.bytes_paged - paged0,
                }
            )

        evictor.swap = recorded
        greedy_decode(model, ids, cache, STEPS)
        stats = cache.reselect_stats
    return steps, stats


def _both(earlier: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """``earlier & later`` over the positions of ``earlier`` (``later`` saw more tokens written)."""
    return earlier & later[..., : earlier.shape[-1]]


def test_swap_promotes_only_tokens_on_the_device_and_pages_them_in_once(models):
    """With a device budget that leaves persistent recall little room: (1) under persistent recall some token's values
    are paged in at two consecutive reads of the same (layer, row, KV head) — the traffic swapping removes; (2) under
    swap every promoted token was on the device (paged in by the read just before, or held), so a swap's page-in is
    only the tokens completing a carried held page, and a token it promoted is resident — not paged in — at the
    next read of that layer: a token needed at both reads was paged in once."""
    budget = 0.45
    steps, _ = _paged_in(models, "persistent", budget)
    twice = 0
    by_layer: dict[int, dict] = {}
    for s in steps:
        prev = by_layer.get(s["layer"])
        if prev is not None:
            twice += int(_both(prev["fresh"], s["fresh"]).sum())
        by_layer[s["layer"]] = s
    assert twice > 0

    steps, stats = _paged_in(models, "swap", budget)
    assert stats is not None and stats.promoted > 0
    promoted_total, kept = 0, 0
    by_layer = {}
    for s in steps:
        promoted = s["after"] & ~s["resident"]
        assert not bool((promoted & ~(s["fresh"] | s["held"])).any())  # nothing promoted from the host alone
        stay = s["held"] & ~s["after"]
        completing = int((s["new_held"] & ~stay).sum())
        assert s["paged"] == completing * 2 * D * 4  # float32 K and V
        prev = by_layer.get(s["layer"])
        if prev is not None:
            prev_promoted = prev["after"] & ~prev["resident"]
            assert not bool(_both(prev_promoted, s["fresh"]).any())  # promoted last step: not paged in again
            kept += int(_both(prev_promoted, s["resident"]).sum())
        promoted_total += int(promoted.sum())
        by_layer[s["layer"]] = s
    assert promoted_total == stats.promoted and kept > 0


@pytest.mark.parametrize("keys", ["dither-int8", "dither-int6"])
def test_swap_refuses_dithered_codecs(models, keys):
    with pytest.raises(ValueError, match=f'recall="swap" cannot be combined with the dithered codec {keys!r}'):
        resident = EvictionConfig.resident_set(0.25, recall="swap")
        CertifiedCache(models["llama"], keys=keys, values="int8", gate=Gate.certified(0.2), eviction=resident)


def test_unknown_recall_is_refused_and_names_swap():
    with pytest.raises(ValueError, match="recall must be one of persistent, transient, swap, got 'bogus'"):
        EvictionConfig.resident_set(0.25, recall="bogus")


def _store_state(store) -> dict[str, torch.Tensor]:
    """Every per-token tensor of ``store`` (tiers, witnesses, positions, packed codes) and its archive, the archive
    sorted by position per (row, KV head) (its order is free: the summary re-orders it)."""
    state = {
        f"{t}.{name}": getattr(getattr(store, t), name).view() for t in "kv" for name in ("host", "served", "exact")
    }
    for i, buf in enumerate(store._token_buffers()):
        state[f"token{i}"] = buf.view()
    for t in "kv":
        for i, chunk in enumerate(getattr(store, t).chunks):
            state.update({f"{t}.chunk{i}.{name}": x for name, x in chunk.packed.tensors.items()})
    order = store.evicted["positions"].view().argsort(-1)
    for name, buf in store.evicted.items():
        x = buf.view()
        state[f"evicted.{name}"] = x.gather(2, order.reshape(*order.shape, *[1] * (x.dim() - 3)).expand_as(x))
    return state


@pytest.mark.parametrize("codec", ["int4", "none"])
def test_promoting_only_the_chosen_archive_tokens_equals_promoting_the_whole_archive(models, codec):
    """``EvictionDriver._promote_chosen`` encodes only the archive tokens some head chooses; the store (every tier,
    witness, position, packed code, and the archive up to its order) equals per element the reference that promotes
    the whole archive and gathers the chosen slots."""
    from kvcert.attention.evict_driver import EvictionDriver

    model = models["llama"]
    ids = prompt_ids(model, batch=2, seed=5)
    stores = []
    for _ in range(2):  # two identical stores (a store's numpy-backed buffers do not survive copy.deepcopy)
        with resident_cache(model, codec, "snapkv", Gate.off()) as cache:
            greedy_decode(model, ids, cache, 2)
            stores.append(cache.layers[1].store)
    ours, ref = stores
    n, archive = ref.n, ref.evicted["positions"].view().shape[-1]
    gen = torch.Generator().manual_seed(0)
    b, h = ref.positions.view().shape[:2]
    # every head keeps n slots of [resident, archive], a different mix per head (some archive slots for each)
    chosen = torch.stack([torch.randperm(n + archive, generator=gen)[:n] for _ in range(b * h)]).view(b, h, n)
    chosen = chosen.sort(-1).values
    assert bool((chosen >= n).any(-1).all()) and bool((chosen < n).any(-1).all())
    EvictionDriver._promote_chosen(ours, chosen, n)
    ev = ref.evicted
    ref.promote(ev["k"].view(), ev["v"].view(), ev["positions"].view())
    ref.evicted = {}
    ref.gather(chosen, retain_evicted=True)
    got, want = _store_state(ours), _store_state(ref)
    assert got.keys() == want.keys()
    for name, x in want.items():
        assert torch.equal(got[name], x), name
