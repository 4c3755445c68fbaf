"""Persistent recall with held pages as 16-bit device tensors: per-cell soundness of reads that serve held pages from
their copies, the device budget from the tensors' bytes, exact copies of a 16-bit host tier, and pages beyond the
float16 range never held."""

from __future__ import annotations

import pytest
import torch
from resident_cases import POLICIES, assert_sound_in_every_cell, greedy_decode, prompt_ids

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.attention import resident
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

STEPS = 8


@pytest.fixture(scope="module")
def models():
    return {family: tiny_random(family, head_dim=32) for family in ("llama", "qwen2")}


def _cache(
    model, codec: str = "int4", tau: float = 0.1, budget: float | None = 3.0, validate: bool = True, **kw
) -> CertifiedCache:
    return CertifiedCache(
        model,
        gate=Gate.certified(tau),
        validate=validate,
        storage=StorageConfig(keys=codec, values=codec, device_budget=budget),
        eviction=EvictionConfig.resident_set(
            0.25, select=kw.pop("select", POLICIES["h2o"]()), page_size=4, recall="persistent", **kw
        ),
    )


class _HeldReads:
    """Wraps ``resident.grow_recall``: counts the reads that served held pages and checks that every held token was
    served from its 16-bit copy (its served value is the slot's, not the host tier's)."""

    def __init__(self, monkeypatch) -> None:
        self.real = resident.grow_recall
        self.reads = 0
        monkeypatch.setattr(resident, "grow_recall", self)

    def __call__(self, ov, bi, hi, order, order_host, k, n_held, l_res, c_res):
        r = yield from self.real(ov, bi, hi, order, order_host, k, n_held, l_res, c_res)
        if n_held:
            self.reads += 1
            ps, held = ov.page_size, ov.held
            for page in order[:n_held].tolist():
                slot = int(held.slot[bi, hi, page])
                for j, t in enumerate(range(page * ps, min((page + 1) * ps, ov.keys.shape[2]))):
                    served = r.values[int((r.tok == t).nonzero())]
                    assert torch.equal(served, held.v_slots[slot, j].to(torch.float32))
        return r


def _check_held_tensors(cache) -> None:
    """Every layer's held pages: ``nbytes`` is the bytes of the allocated tensors, and every held page's slot holds its
    host K/V rounded to the storage dtype (zero past the archive's end)."""
    for layer, pages in cache._pages.items():
        h = pages.held
        assert h is not None
        assert h.nbytes == sum(t.untyped_storage().nbytes() for t in (h.k_slots, h.v_slots, h.slot, h.score))
        assert h.k_slots.shape[0] == int(h.held.sum()) and h.k_slots.dtype.itemsize == 2
        ev = cache.layers[layer].store.evicted
        k, v = ev["k"].view(), ev["v"].view()
        for bi, hi, p in h.held.nonzero().tolist():
            toks = slice(p * h.page_size, min((p + 1) * h.page_size, k.shape[2]))
            n = toks.stop - toks.start
            slot = int(h.slot[bi, hi, p])
            assert torch.equal(h.k_slots[slot, :n], k[bi, hi, toks].to(torch.float32).to(h.k_slots.dtype))
            assert torch.equal(h.v_slots[slot, :n], v[bi, hi, toks].to(torch.float32).to(h.v_slots.dtype))
            assert not bool(h.k_slots[slot, n:].any())


def _bytes(cache) -> tuple[int, int]:
    """``(device bytes from the tensors, fp16 K/V bytes of every written token)`` of the cache now."""
    stores = [layer.store for layer in cache.layers]
    device = sum(s.bytes_device() for s in stores) + sum(p.nbytes for p in cache._pages.values())
    fp16 = sum(s.bytes_fp16() + 2 * (s.evicted["k"].view().numel() + s.evicted["v"].view().numel()) for s in stores)
    return device, fp16


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("codec", "summary"), [("none", "int8"), ("int4", "int8"), ("int8", "box")])
def test_reads_serving_held_pages_from_16_bit_copies_are_sound_in_every_cell(
    models, family, codec, summary, monkeypatch
):
    """Validate mode, persistent recall under a 3x device budget: reads serve held pages from their float16 copies
    (checked token by token), 0 violations per cell (true TV <= certificate, output error <= output bound)."""
    model = models[family]
    spy = _HeldReads(monkeypatch)
    with _cache(model, codec, summary=summary) as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=3), cache, STEPS, each=_check_held_tensors)
        tel = cache.telemetry()
    assert spy.reads > 0 and tel.bytes_held > 0
    assert_sound_in_every_cell(tel)
    assert bool((tel.served[tel.recorded] <= 0.1).all())


@pytest.mark.parametrize("budget", [0.8, 3.0])
def test_the_device_budget_holds_at_every_step_with_bytes_from_the_tensors(models, budget):
    """After every forward the device bytes (stores, summaries, held slot tensors, measured from the tensors) stay
    within the budget times the fp16 K/V of every written token, up to the tokens the layers wrote after the forward's
    budget check (one exact float32 token per layer, row and KV head); at 0.8 the budget binds (held pages fill it);
    telemetry's bytes_device is that sum; held pages cut the page-in traffic of transient recall."""
    model = models["llama"]
    cfg = model.config
    slack = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 2 * 32 * 4
    ratio: list[float] = []
    over: list[int] = []

    def check(cache) -> None:
        device, fp16 = _bytes(cache)
        over.append(device - int(budget * fp16 + slack))
        ratio.append(device / fp16)

    ids = prompt_ids(model, batch=2, seed=7)
    with _cache(model, budget=budget, validate=False) as cache:
        greedy_decode(model, ids, cache, STEPS, each=check)
        tel = cache.telemetry()
        stores = sum(layer.store.bytes_device() for layer in cache.layers)
    assert max(over) <= 0 and tel.bytes_held > 0
    assert max(ratio) >= 0.97 * budget if budget < 1 else max(ratio) < budget  # binding / not binding
    assert tel.bytes_device == stores + tel.bytes_summary + tel.bytes_held
    with CertifiedCache(
        model,
        keys="int4",
        values="int4",
        gate=Gate.certified(0.1),
        eviction=EvictionConfig.resident_set(0.25, select=POLICIES["h2o"](), page_size=4, recall="transient"),
    ) as transient:
        greedy_decode(model, ids, transient, STEPS)
        assert tel.bytes_recalled < transient.telemetry().bytes_recalled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_holds_exact_copies(dtype, monkeypatch):
    """A 16-bit model's host tier is already 16-bit: held pages are stored in its dtype, bit for bit, with zero
    rounding radius, and every cell is sound."""
    model = tiny_random("llama", head_dim=32).to(dtype)
    radii: list[float] = []
    real = resident.HeldPages.rounding_radius

    def spy(self, copy):
        e = real(self, copy)
        radii.append(float(e.max()) if e.numel() else 0.0)
        return e

    monkeypatch.setattr(resident.HeldPages, "rounding_radius", spy)
    with _cache(model, "none", budget=None) as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=3), cache, STEPS, each=_check_held_tensors)
        assert all(p.held is not None and p.held.k_slots.dtype == dtype for p in cache._pages.values())
        tel = cache.telemetry()
    assert radii and max(radii) == 0.0 and tel.bytes_held > 0
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0


def test_values_beyond_the_float16_range_are_never_held_and_paged_in_every_read(monkeypatch):
    """Layer 0's values scaled past 65504: none of its pages can be held in float16 (fail closed), so each of its
    recalls is paged in (and counted) at every read that needs it; the other layer holds pages; 0 violations."""
    model = tiny_random("llama", head_dim=32)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(1e6)
    with _cache(model, "int8", budget=None, select=POLICIES["streaming"]()) as cache:
        greedy_decode(model, prompt_ids(model, batch=2, seed=3), cache, STEPS)
        v0 = cache.layers[0].store.evicted["v"].view()
        assert float(v0.abs().max()) > 65504
        held = {layer: int(p.held.held.sum()) for layer, p in cache._pages.items()}
        recs = cache.resident_records
        tel = cache.telemetry()
    assert held[0] == 0 and held[1] > 0
    layer0 = [r.pages for r in recs if r.layer == 0 and r.step > 0]
    assert sum(layer0) > 0 and sum(1 for n in layer0 if n > 0) >= 2  # recalled again at later reads
    assert tel.violations == 0 and tel.out_violations == 0 and tel.recall_violations == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dropping_the_held_rounding_radius_is_caught_per_cell(models, family, monkeypatch):
    """At tau = 1e-5 (exact resident codes) reads recall every page and the certificate is the meter of the served
    logits: the held keys' float16 rounding is then the largest logit error. With its radius: 0 violations; with the
    radius planted to 0, true TV above the certificate and output errors above the bound in some cells."""
    model = models[family]
    ids = prompt_ids(model, batch=2, seed=3)
    found = []
    for planted in (False, True):
        if planted:
            monkeypatch.setattr(
                resident.HeldPages, "rounding_radius", lambda self, c: torch.zeros(c.shape[:-1], dtype=torch.float64)
            )
        with _cache(model, "none", tau=1e-5, budget=None, summary="int8") as cache:
            greedy_decode(model, ids, cache, STEPS)
            tel = cache.telemetry()
        found.append((tel.recall_violations, tel.out_violations))
        assert tel.bytes_held > 0
    assert found[0] == (0, 0) and min(found[1]) > 0
