"""Bad input to the Python API (docs/reliability.md, "Probes tried and held"): each is refused by name before anything
is stored, or answered honestly, and a refused call leaves the cache serving."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import kvcert.quant as quant
from kvcert import CertifiedCache, EvictionConfig, Gate, StorageConfig
from kvcert.bounds import telescoping_delta, uniform_split
from kvcert.evict import H2O, StreamingLLM
from kvcert.models.tiny import tiny_random


@pytest.fixture(scope="module")
def model():
    return tiny_random("llama", head_dim=32)


def _ids(n: int, b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 200, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tau": "0.2"}, "threshold must be a real number"),
        ({"tau": True}, "threshold must be a real number"),
        ({"value_tol": "0.1"}, "value_tol must be a real number"),
        ({"persistent": "no"}, "persistent must be a bool"),  # used to read as true
        ({"box": "no"}, "box must be a bool"),
        ({"granularity": "block", "block_size": 2.5}, "block_size must be an int"),  # used to fail inside torch
    ],
)
def test_gate_refuses_values_of_the_wrong_type(kw, match):
    with pytest.raises(TypeError, match=match):
        Gate.certified(**kw)


@pytest.mark.parametrize("kw", [{"threshold": 0.2}, {"value_tol": 0.0}, {"persistent": True}])
def test_an_off_gate_takes_nothing_that_repairs(kw):
    """``Gate("off", value_tol=0.0)`` used to promote every value while describing itself as off."""
    with pytest.raises(ValueError, match="an off gate never repairs"):
        Gate("off", **kw)
    assert Gate.certified(np.float32(0.2)).threshold == pytest.approx(0.2)  # numpy reals stay accepted


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"validate": "no"}, "validate must be a bool"),  # used to turn validation on
        ({"ladder": "yes"}, "ladder must be a bool or a LadderConfig"),
        ({"require_identity": "no"}, "require_identity must be a bool"),
        ({"observers": None}, "observers must be a sequence"),
        ({"observers": [object()]}, "has no on_write or on_read"),  # used to fail mid-forward
        ({"request_ids": [0.7]}, "request_ids must be a 1-d sequence of ints"),  # used to become request 0
        ({"request_ids": torch.tensor([1.9])}, "request_ids must be"),
        ({"request_ids": [True]}, "request_ids must be"),
    ],
)
def test_cache_keywords_of_the_wrong_type_are_refused_by_name(model, kw, match):
    with pytest.raises(TypeError, match=match):
        CertifiedCache(model, keys="int4", values="int4", **kw)


@pytest.mark.parametrize("ids", [[3], (np.int64(3),), np.array([3]), torch.tensor([3])])
def test_integer_request_ids_of_any_kind_are_taken(model, ids):
    with CertifiedCache(model, keys="int4", values="int4", request_ids=ids) as cache:
        assert cache.request_ids is not None and cache.request_ids.tolist() == [3]


@pytest.mark.parametrize("b", [3, 1])
def test_a_batch_change_within_a_request_is_refused_and_the_cache_keeps_serving(model, b):
    """The write is refused before anything is stored (it used to fail deep in the store and count a phantom step),
    and the request goes on."""
    with CertifiedCache(model, keys="int4", values="int4") as cache:
        model(_ids(40, 2), cache=cache)
        with pytest.raises(ValueError, match=f"the batch changed from 2 to {b} rows"):
            model(_ids(1, b), cache=cache)
        model(_ids(1, 2), cache=cache)
        tel = cache.telemetry()
    assert tel.certificates.shape[0] == 1  # one decode step read a compressed cache, not two
    assert cache.layers[0].store.n == 41


def test_ingest_refuses_a_source_with_other_kv_heads(model):
    from transformers import DynamicCache

    src = DynamicCache()
    heads = model.config.num_key_value_heads
    for i in range(model.config.num_hidden_layers):
        src.update(torch.randn(1, heads + 2, 8, 32), torch.randn(1, heads + 2, 8, 32), i)
    with CertifiedCache(model, keys="int4", values="int4") as cache, pytest.raises(ValueError, match="KV heads"):
        cache.ingest(src)


def test_violations_are_none_without_validate_mode(model):
    """Nothing was checked, so no count: ``0`` used to read as a clean check."""
    with CertifiedCache(model, keys="int4", values="int4") as cache:
        model(_ids(40), cache=cache)
        model(_ids(1), cache=cache)
        tel = cache.telemetry()
    assert tel.violations is None and tel.out_violations is None
    assert tel.summary()["violations"] is None
    with CertifiedCache(model, keys="int4", values="int4", validate=True) as cache:
        model(_ids(40), cache=cache)
        model(_ids(1), cache=cache)
        assert cache.telemetry().violations == 0


def test_a_resident_set_too_small_for_the_prompt_is_named_in_its_terms(model):
    with CertifiedCache(model, keys="int8", values="int4", eviction=EvictionConfig.resident_set(0.25)) as cache:
        with pytest.raises(
            ValueError, match=r"resident=0.25 keeps 10 of the prompt's 40 tokens .* SnapKV always keeps"
        ):
            model(_ids(40), cache=cache)


def test_a_decode_budget_policy_serves_one_live_cache(model):
    """Sharing one stateful policy between two live caches used to fail at the second prefill with "positions
    disagree with the slots the policy holds"; once the first cache is gone the policy is reset and reused."""
    eviction = EvictionConfig.decode_budget(H2O(recent=2), 24)
    first = CertifiedCache(model, keys="int8", values="int4", eviction=eviction)
    model(_ids(40), cache=first)
    with pytest.raises(ValueError, match="build a new policy"):
        CertifiedCache(model, keys="int8", values="int4", eviction=eviction)
    first.detach()
    del first
    gc.collect()
    with CertifiedCache(model, keys="int8", values="int4", eviction=eviction) as second:
        model(_ids(40, seed=1), cache=second)
        model(_ids(1), cache=second)


@pytest.mark.parametrize("name", ["a b", "x:y", "k/v", "mixed[x]", "a,b"])
def test_register_refuses_names_the_command_line_cannot_carry(name):
    with pytest.raises(ValueError, match="must not contain"):
        quant.register(name, lambda x: x)


def test_a_registered_name_starting_with_kivi_is_a_plain_function():
    """``resolve`` used to give every name starting with "kivi" KIVI's ``axis`` option, which a registered function
    refuses."""
    quant.register("kivi-like", lambda x: x.clone())
    try:
        assert quant.resolve("kivi-like", "key").name == "kivi-like"
        assert quant.resolve("kivi-2", "key").axis == "key"
    finally:
        quant.unregister("kivi-like")
    with pytest.raises(TypeError, match="a codec is a name"):
        quant.resolve(123, "key")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="axis must be"):
        quant.resolve("int4", "kee")  # type: ignore[arg-type]


def test_a_detached_cache_cannot_be_attached_again(model):
    """``attach()`` after ``detach()`` used to put the model back on kvcert attention with a cache that refuses every
    write; it is refused and the model keeps its own attention."""
    from kvcert.integrations.certified_layer import CacheClosedError

    before = model.config._attn_implementation
    cache = CertifiedCache(model, keys="int4", values="int4")
    cache.detach()
    with pytest.raises(CacheClosedError):
        cache.attach()
    assert model.config._attn_implementation == before


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: uniform_split(0.1, 1.5, 2, 3), "layers must be an int"),
        (lambda: telescoping_delta(0.5, 0.1), "k must be an int"),  # type: ignore[arg-type]
        (lambda: StreamingLLM(sinks=2.5), "sinks must be an int"),  # type: ignore[arg-type]
        (lambda: StorageConfig(write_block=2.5, seed=0).store(0), "write_block must be an int"),  # type: ignore[arg-type]
    ],
)
def test_fractional_counts_are_refused(call, match):
    """A fractional layer count or step index would under-split a failure budget (``uniform_split``: the union runs
    over whole cells; ``telescoping_delta``: over whole steps); a fractional sink count or write block used to fail
    later, inside torch."""
    with pytest.raises(ValueError, match=match):
        call()


def test_value_term_quantile_refuses_a_q_outside_zero_one(model):
    with CertifiedCache(model, keys="int4", values="int4") as cache:
        model(_ids(40), cache=cache)
        model(_ids(1), cache=cache)
        tel = cache.telemetry()
    assert 0 <= tel.value_term_quantile(0.5) <= tel.value_term_quantile(1.0)
    with pytest.raises(ValueError, match="quantile in"):
        tel.value_term_quantile(1.5)
