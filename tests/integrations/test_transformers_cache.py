"""CertifiedCache inside transformers: exactness, per-cell soundness, bytes, padding, sliding windows, detach."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcert
from kvcert import Gate, StorageConfig
from kvcert.integrations.certified_layer import CacheClosedError
from kvcert.integrations.model_attention import CacheNotActiveError
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

CODECS = [
    ("int8", "int8"),
    ("int4", "int4"),
    ("int2", "int2"),
    ("dither-int8", "int4"),
    ("fp8-e4m3", "fp8-e4m3"),
    ("kivi-2", "kivi-2"),
    ("kvquant-4", "int4"),
    ("sign-1", "int4"),
    ("hadamard-int4", "int4"),
    ("hadamard-int2", "int2"),
]


def _tiny(family):
    """Tiny random model with head_dim 32 (codecs use 32-channel scale groups)."""
    return tiny_random(family, head_dim=32)


def _greedy(model, ids, cache, steps, attention_mask=None):
    out = model.generate(
        ids,
        attention_mask=attention_mask,
        cache=cache,
        max_new_tokens=steps,
        do_sample=False,
        min_new_tokens=steps,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :]


def _decode_loop(model, ids, cache, steps):
    """Manual forward loop (prefill + greedy decode); returns generated tokens."""
    out = model(ids, cache=cache, use_cache=True)
    toks = []
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        toks.append(nxt)
        out = model(nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    return torch.cat(toks, 1)


@pytest.mark.parametrize("keys", ["int2", "hadamard-int4", "hadamard-int2"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_repair_everything_equals_dynamic_cache(family, keys):
    model = _tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _decode_loop(model, ids, DynamicCache(config=model.config), 12)
    cache = CertifiedCache(model, keys=keys, values="int2", gate=Gate.certified(tau=0.0))
    got = _decode_loop(model, ids, cache, 12)
    cache.detach()
    assert torch.equal(ref, got)
    tel = cache.telemetry()
    assert tel.cells > 0 and tel.fallback_rate == 1.0


@pytest.mark.parametrize("keys,values", CODECS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_validate_mode_zero_violations_per_cell(family, keys, values):
    model = _tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = CertifiedCache(model, keys=keys, values=values, validate=True, seed=3)
    _decode_loop(model, ids, cache, 10)
    cache.detach()
    tel = cache.telemetry()
    # every decode step of every layer that holds compressed entries is certified (KIVI's 32-token blocks and
    # residual window never fill a sliding window of 8)
    layers = [layer for layer in cache.layers if not (layer.is_sliding and keys.startswith("kivi"))]
    assert tel.cells >= 10 * len(layers)
    assert tel.true_tv is not None and tel.violations == 0, tel.summary()
    assert tel.out_violations == 0, tel.summary()
    rec = tel.recorded
    assert torch.all(tel.true_tv[rec] <= tel.certificates[rec])
    assert torch.all(tel.true_out_err[rec] <= tel.out_bound[rec])


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # GQA (Gemma-3's tiny config is MQA: one KV head)
def test_partial_head_repair_in_the_model_is_exact_per_head(family):
    """τ at the median ungated certificate: some KV heads of a read are repaired, others not; the repaired
    ones come from SDPA over only those heads (and their query heads) and must stay within the evaluation
    slack of exact attention, the others within their two-term bound."""
    model = _tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    probe = CertifiedCache(model, keys="int4", values="int8", seed=1)
    _decode_loop(model, ids, probe, 6)
    probe.detach()
    certs = probe.telemetry().certificates
    tau = float(certs[~torch.isnan(certs)].median())
    cache = CertifiedCache(model, keys="int4", values="int8", gate=Gate.certified(tau), validate=True, seed=1)
    _decode_loop(model, ids, cache, 6)
    cache.detach()
    tel = cache.telemetry()
    rep = tel.repaired[1:].flatten(0, 1)  # decode reads [reads, B, Hkv]
    assert bool((rep.any(-1) & ~rep.all(-1)).any()), "no read repaired only some of its KV heads"
    assert tel.violations == 0 and tel.out_violations == 0, tel.summary()


def test_certified_gate_serves_every_cell_under_tau():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(2))
    for gran in ("head", "block"):
        cache = CertifiedCache(
            model,
            keys="int2",
            values="int8",
            gate=Gate.certified(0.05, granularity=gran, block_size=8),
            validate=True,
            seed=0,
        )
        _decode_loop(model, ids, cache, 8)
        cache.detach()
        tel = cache.telemetry()
        rec = tel.recorded
        assert torch.all(tel.served[rec] <= 0.05 + 1e-12)
        assert tel.violations == 0 and tel.out_violations == 0
        assert tel.fallback_rate > 0


@pytest.mark.parametrize("family,exercised", [("llama", False), ("qwen2", False), ("mistral", False), ("gemma3", True)])
def test_tier_b_gate_validate_mode_and_budget(family, exercised):
    """A Tier-B gate through the cache (head dimension 256, where Tier B is tighter than Tier A), validate mode:
    0 violations of the certified and output bounds and 0 of the partial bound; every recorded KV-head read is
    repaired, certified ``<= tau``, or served on the partial bound ``<= tau`` (and flagged); the partial bound is
    never above the certified one; the most δ a row spent stays within the request budget and is at most the cells
    charged times ``δ_loc``; the summary names all of it. The tiny Gemma-3's reads need Tier B at this ``tau`` (the
    others' are certified by Tier A alone)."""
    model, tau = tiny_random(family, head_dim=256), 0.03
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    gate = Gate.certified(tau, box=True, tier_b=True)
    cache = CertifiedCache(model, keys="dither-int8", values="int8", gate=gate, validate=True, seed=3)
    _decode_loop(model, ids, cache, 10)
    cache.detach()
    tel, s = cache.telemetry(), cache.telemetry().summary()
    assert tel.violations == 0 and tel.out_violations == 0 and tel.partial_violations == 0, s
    rec = tel.recorded
    assert tel.served_partial is not None and tel.tier_b_reads is not None
    assert torch.all(tel.served_partial[rec] <= tel.served[rec])
    g = tel.group_size
    kv = lambda x: x.unflatten(-1, (-1, g)).amax(-1)  # noqa: E731 (worst query head of each KV head)
    rec_kv = rec.unflatten(-1, (-1, g)).any(-1)
    certified_ok = kv(torch.nan_to_num(tel.served, 2.0)) <= tau
    partial_ok = tel.tier_b_reads & (kv(torch.nan_to_num(tel.served_partial, 2.0)) <= tau)
    assert torch.all((tel.repaired | certified_ok | partial_ok)[rec_kv])
    assert not torch.any(tel.tier_b_reads & tel.repaired)
    assert s["tier_b_delta_spent"] <= cache.validation.delta_req
    assert s["tier_b_delta_spent"] <= s["tier_b_cells"] * cache._delta_loc
    assert s["partial_violations"] == 0 and s["tier_b_read_share"] == tel.tier_b_read_share
    assert tel.tiers["served_partial"].startswith("partially certified")
    assert (tel.tier_b_read_share > 0) == exercised and (s["tier_b_cells"] > 0) == exercised


def test_tier_b_gate_needs_dithered_keys():
    with pytest.raises(ValueError, match="needs a dithered key codec"):
        CertifiedCache(_tiny("llama"), keys="int8", values="int4", gate=Gate.certified(0.2, box=True, tier_b=True))


def test_persistent_block_repair_zeroes_radius():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(4))
    cache = CertifiedCache(
        model,
        keys="int2",
        values="int8",
        gate=Gate.certified(0.01, granularity="block", block_size=4, persistent=True),
        seed=0,
    )
    _decode_loop(model, ids, cache, 4)
    cache.detach()
    store = cache.layers[0].store
    exact = store.k.exact.view()
    assert exact.any()
    assert torch.all(store.k_band.view()[exact] == 0)
    assert torch.equal(store.k.served.view()[exact], store.k.host.view()[exact].float())


def test_risk_ranked_gate_uses_unclipped_meter():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    cache = CertifiedCache(model, keys="fp8-e4m3", values="fp8-e4m3", gate=Gate.risk_ranked(5.0), seed=0)
    _decode_loop(model, ids, cache, 6)
    cache.detach()
    tel = cache.telemetry()
    rec = tel.recorded
    kv = tel.raw.reshape(*tel.raw.shape[:3], -1, tel.group_size).amax(-1)
    assert torch.equal(tel.repaired[rec.reshape(*kv.shape, -1).any(-1)], (kv > 5.0)[rec.reshape(*kv.shape, -1).any(-1)])


def test_bytes_int8_keys_int4_values_under_045_of_fp16():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(6))
    cache = CertifiedCache(model, keys="int8", values="int4")
    _decode_loop(model, ids, cache, 2)
    cache.detach()
    for layer in cache.layers:
        layer.store.encode_pending()
    tel = cache.telemetry()
    assert tel.bytes_stored <= 0.45 * tel.bytes_fp16, (tel.bytes_stored, tel.bytes_fp16)
    # bytes come from the stored tensors: the packed chunk tensors add up to the reported number
    store = cache.layers[0].store
    measured = sum(
        t.numel() * t.element_size() for ts in (store.k, store.v) for c in ts.chunks for t in c.packed.tensors.values()
    )
    assert measured == store.k.packed_nbytes() + store.v.packed_nbytes()


def test_generate_batch_two_with_left_padding():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))
    ids[1, :6] = 0
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ref = _greedy(model, ids, DynamicCache(config=model.config), 6, attention_mask=mask)
    cache = CertifiedCache(model, keys="int8", values="int8", gate=Gate.certified(0.0), validate=True)
    got = _greedy(model, ids, cache, 6, attention_mask=mask)
    cache.detach()
    assert torch.equal(ref, got)
    assert cache.telemetry().violations == 0


def test_sliding_window_layers_trim_and_stay_exact_under_full_repair():
    model = _tiny("gemma3")
    window = model.config.sliding_window
    ids = torch.randint(3, model.config.vocab_size, (1, 3 * window), generator=torch.Generator().manual_seed(8))
    ref = _decode_loop(model, ids, DynamicCache(config=model.config), 2 * window)
    cache = CertifiedCache(model, keys="int4", values="int4", gate=Gate.certified(0.0))
    got = _decode_loop(model, ids, cache, 2 * window)
    cache.detach()
    assert torch.equal(ref, got)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer.store.n <= window for layer in sliding)


def test_detach_restores_attention_and_closed_cache_raises():
    model = _tiny("llama")
    before = model.config._attn_implementation
    with CertifiedCache(model, keys="int8", values="int8") as cache:
        assert model.config._attn_implementation == "kvcert"
    assert model.config._attn_implementation == before
    ids = torch.randint(3, model.config.vocab_size, (1, 8))
    with pytest.raises(CacheClosedError):
        model(ids, cache=cache)


def test_a_cache_that_is_not_the_models_active_one_raises_instead_of_serving_uncertified():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 8))
    first = CertifiedCache(model, keys="int8", values="int8")
    second = CertifiedCache(model, keys="int8", values="int8")  # takes over the model's attention modules
    with pytest.raises(CacheNotActiveError, match=r"cache.attach\(\)"):
        model(ids, cache=first)
    model(ids, cache=second)
    first.attach()  # active again: certified reads resume
    long = torch.randint(3, model.config.vocab_size, (1, 40))
    model(long, cache=first)
    model(long[:, :1], cache=first)  # a decode read over compressed entries
    assert first.telemetry().certificates.shape[0] >= 1
    model.set_attn_implementation("sdpa")  # kvcert attention switched off behind its back
    with pytest.raises(CacheNotActiveError):
        model(ids[:, :1], cache=first)
    first.detach()
    second.detach()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_model_the_cache_was_not_built_for_is_refused_before_it_returns_output(family):
    """Another instance of the model (same config, its own attention modules, no kvcert attention) would read the
    compressed K/V the cache returns with plain SDPA, uncertified. The cache refuses at the next layer's write, so
    that forward returns nothing; the layer named is the one read without a certificate."""
    model, other = _tiny(family), _tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (1, 40))
    cache = CertifiedCache(model, keys="int2", values="int2", gate=Gate.certified(0.0))
    with pytest.raises(CacheNotActiveError, match="layer 0 of this CertifiedCache was written but no kvcert read"):
        other(ids, cache=cache)
    with pytest.raises(CacheNotActiveError):  # nothing of that request can be served certified any more
        model(ids, cache=cache)
    cache.detach()
    with CertifiedCache(model, keys="int2", values="int2", gate=Gate.certified(0.0)) as fresh:
        _greedy(model, ids, fresh, 3)  # the model it was built for reads every layer through kvcert
        assert fresh.telemetry().cells > 0


@pytest.mark.parametrize("ladder", [False, True])
def test_reset_serves_a_new_request_as_a_fresh_cache_does(ladder):
    """After ``reset()`` the cache serves a second prompt exactly as a fresh cache of the same configuration: the same
    tokens, cells, steps, certificates, bytes and (ladder) rung counts; nothing of the first request is left."""
    model = _tiny("llama")
    first, second = (
        torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)) for n in (40, 36)
    )
    gate = Gate.off() if ladder else Gate.certified(0.2)
    reused = CertifiedCache(model, keys="int4", values="int4", gate=gate, ladder=ladder, seed=1)
    _greedy(model, first, reused, 4)
    reused.reset()
    again = _greedy(model, second, reused, 3)
    got = reused.telemetry()
    reused.detach()
    with CertifiedCache(model, keys="int4", values="int4", gate=gate, ladder=ladder, seed=1) as fresh:
        want_tokens = _greedy(model, second, fresh, 3)
        want = fresh.telemetry()
        want_rungs = fresh.ladder_stats
    assert torch.equal(again, want_tokens)
    assert got.certificates.shape[0] == want.certificates.shape[0]  # the steps
    assert (got.cells, got.bytes_device, got.bytes_paged) == (
        want.cells,
        want.bytes_device,
        want.bytes_paged,
    )
    assert torch.equal(got.certificates, want.certificates)
    counters = ("reads", "cells", "rung1", "rung2", "rung3", "rung4", "blocks_paged")
    assert [getattr(reused.ladder_stats, c) for c in counters] == [getattr(want_rungs, c) for c in counters]


def test_unsupported_family_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="supported: llama"):
        CertifiedCache(model)


def test_non_finite_inputs_are_counted_through_the_cache():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 20))
    cache = CertifiedCache(model, storage=StorageConfig(keys="int8", values="int8", write_block=1))
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")  # NaN keys in layer 0
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    cache.detach()
    store = cache.layers[0].store
    assert store.nonfinite > 0 and store.k.exact.view()[:, 0, :20].all()
    assert cache.telemetry().nonfinite == sum(layer.store.nonfinite for layer in cache.layers)


def test_fail_closed_rows_without_identity_stay_exact():
    model = _tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 16))
    cache = CertifiedCache(model, keys="int4", values="int4", request_ids=[7, -1], require_identity=True)
    _decode_loop(model, ids, cache, 2)
    cache.detach()
    store = cache.layers[0].store
    assert store.k.exact.view()[1].all() and not store.k.exact.view()[0].all()
    assert cache.telemetry().fail_closed > 0


def test_public_api_is_exported():
    assert kvcert.CertifiedCache is CertifiedCache
    assert kvcert.Gate is Gate
