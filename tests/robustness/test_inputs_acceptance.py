"""What the library used to accept quietly (issue 21, item 5): half precision, sliding windows smaller than a
write block, detach order of two caches, empty decodes, infinite gate thresholds."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import DynamicCache

from kvcert import Gate, StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)


def _decode(model: torch.nn.Module, ids: torch.Tensor, cache: object, steps: int) -> torch.Tensor:
    """Prefill ``ids`` through ``cache``, then ``steps`` greedy tokens, one forward each."""
    feed, toks = ids, []
    for _ in range(steps):
        feed = model(feed, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        toks.append(feed)
    return torch.cat(toks, 1)


@pytest.mark.parametrize("tau", [math.inf, float("1e400"), math.nan, -0.1])
def test_gate_refuses_a_threshold_that_certifies_nothing(tau: float) -> None:
    with pytest.raises(ValueError, match="threshold"):
        Gate.certified(tau)
    with pytest.raises(ValueError, match="threshold"):
        Gate.risk_ranked(tau)
    assert Gate.certified(0.0).threshold == 0.0 and Gate.off().mode == "off"


def test_certified_gate_refuses_a_tau_above_one() -> None:
    """A certified tau bounds a total variation, so above 1 it would never repair (and label every read certified):
    refused, pointing to the risk-ranked gate. ``tau = 1`` stays (it gates the values alone with ``value_tol``), and
    a risk-ranked gate ranks the unclipped meter above 1."""
    with pytest.raises(ValueError, match=r"at most 1; got 1\.5.*Gate\.risk_ranked"):
        Gate.certified(1.5)
    assert Gate.certified(1.0, value_tol=0.0).threshold == 1.0
    assert Gate.risk_ranked(1.5).threshold == 1.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "gate", [Gate.off(), Gate.certified(0.05), Gate.certified(0.05, granularity="block", block_size=8)]
)
def test_half_precision_model_validates_per_cell(dtype: torch.dtype, gate: Gate) -> None:
    """A bf16/fp16 model decodes through the cache (its exact tier in the model's dtype, bounds in float32 /
    float64, the served output cast back) with every validated cell under its certificate."""
    model = tiny_random("llama", head_dim=32).to(dtype)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = CertifiedCache(model, keys="int2", values="int4", gate=gate, validate=True, seed=0)
    with torch.no_grad():
        toks = _decode(model, ids, cache, 6)
    cache.detach()
    tel = cache.telemetry()
    assert toks.shape == (1, 6) and tel.cells > 0
    assert cache.layers[0].store.k.host.view().dtype == dtype  # the exact host tier keeps the model's dtype
    rec = tel.recorded
    assert tel.true_tv is not None and bool((tel.true_tv[rec] <= tel.certificates[rec]).all())
    assert tel.true_out_err is not None and bool((tel.true_out_err[rec] <= tel.out_bound[rec]).all())
    assert tel.violations == 0 and tel.out_violations == 0


def test_half_precision_full_repair_equals_dynamic_cache() -> None:
    model = tiny_random("llama", head_dim=32).to(torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = _decode(model, ids, DynamicCache(config=model.config), 5)
        cache = CertifiedCache(model, keys="int2", values="int2", gate=Gate.certified(0.0), seed=0)
        got = _decode(model, ids, cache, 5)
    cache.detach()
    assert torch.equal(ref, got)


@pytest.mark.parametrize(("write_block", "silent"), [(64, True), (65, False)])
def test_a_write_block_longer_than_the_model_context_is_reported(write_block: int, silent: bool) -> None:
    """A write block of more tokens than the model's ``max_position_embeddings`` (here 64) never fills: every layer
    would stay exact with no word. The cache warns and telemetry names the layers; one token less is silent."""
    model = tiny_random("llama", head_dim=32, max_position_embeddings=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = CertifiedCache(
            model, seed=0, storage=StorageConfig(keys="int4", values="int4", write_block=write_block)
        )
    cache.detach()
    named = [w for w in caught if "than one write block" in str(w.message)]
    n_layers = model.config.num_hidden_layers
    if silent:
        assert not named and cache.uncompressed_layers == ()
    else:
        assert named and cache.uncompressed_layers == tuple(range(n_layers))


def test_a_window_of_one_token_holds_none_and_is_reported() -> None:
    """A sliding window of 1 holds ``window − 1 = 0`` tokens when it encodes: uncompressible, whatever the context."""
    from kvcert.integrations.certified_layer import CertifiedLayer, uncompressible_layers

    store = StorageConfig(keys="int4", values="int4", write_block=1, seed=0).store(0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert uncompressible_layers([CertifiedLayer(store, 1), CertifiedLayer(store, 2)], 4096) == (0,)
        assert uncompressible_layers([CertifiedLayer(store, None)], 1) == ()  # one token fills a block of one
        assert uncompressible_layers([CertifiedLayer(store, None)], None) == ()  # context unknown: not checked


@pytest.mark.parametrize(("window", "silent"), [(8, True), (16, True), (17, False)])
def test_sliding_window_smaller_than_a_write_block_is_reported(window: int, silent: bool) -> None:
    """A sliding layer holds window − 1 tokens when it encodes; with write_block=16 (int4: block 1) it can
    encode only if window − 1 >= 16. Below that, the cache warns and telemetry names the layers."""
    model = tiny_random("mistral", head_dim=32, sliding_window=window)
    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = CertifiedCache(model, seed=0, storage=StorageConfig(keys="int4", values="int4", write_block=16))
    _decode(model, ids, cache, 4)
    cache.detach()
    tel = cache.telemetry()
    named = [w for w in caught if "than one write block" in str(w.message)]
    if silent:
        assert named and tel.uncompressed_layers == (0, 1) and tel.summary()["uncompressed_layers"] == 2
        assert tel.cells == 0  # what used to be reported with no word
    else:
        assert not named and tel.uncompressed_layers == () and tel.cells > 0


@pytest.mark.parametrize("order", ["creation", "reverse"])
def test_detaching_two_caches_restores_the_original_attention(order: str) -> None:
    model = tiny_random("llama", head_dim=32)
    original = model.config._attn_implementation
    first = CertifiedCache(model, keys="int8", values="int8")
    second = CertifiedCache(model, keys="int8", values="int8")
    for cache in (first, second) if order == "creation" else (second, first):
        cache.detach()
    assert model.config._attn_implementation == original
    assert not any(hasattr(m, "_kvcert_cache") for m in model.modules())


def test_detaching_a_replaced_cache_leaves_the_active_one_serving() -> None:
    model = tiny_random("llama", head_dim=32)
    first = CertifiedCache(model, keys="int8", values="int8")
    second = CertifiedCache(model, keys="int8", values="int8")
    first.detach()
    ids = torch.randint(3, model.config.vocab_size, (1, 40))
    model(ids, cache=second)
    model(ids[:, :1], cache=second)
    assert model.config._attn_implementation == "kvcert" and second.telemetry().cells > 0
    second.detach()
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("keys", ["int4", "dither-int8"])
def test_an_empty_decode_has_defined_telemetry(keys: str) -> None:
    """A cache that served no compressed read (EOS first): zero cells, every rate None with its key present,
    the same keys as after a real decode, and violations 0 (not None) in validate mode."""
    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40))
    empty = CertifiedCache(model, keys=keys, values="int4", validate=True, seed=0)
    empty.detach()
    used = CertifiedCache(model, keys=keys, values="int4", validate=True, seed=0)
    _decode(model, ids, used, 3)
    used.detach()
    s, full = empty.telemetry().summary(), used.telemetry().summary()
    assert set(s) == set(full)
    assert s["cells"] == 0 and s["violations"] == 0 and s["out_violations"] == 0
    for key in ("coverage_q@0.2", "coverage_kv@0.2", "informative_fraction", "max_certificate", "fallback_rate"):
        assert s[key] is None, key
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in s.values())
    assert full["cells"] > 0 and full["fallback_rate"] == 0.0
