"""CertifiedCache's configuration groups: each builds what its arguments say and names the argument at fault; the
flat keywords and the groups never both set one thing."""

from __future__ import annotations

import pytest
import torch

import kvcert
from kvcert.attention.ladder import LadderConfig
from kvcert.bounds import uniform_split
from kvcert.cache.gate import Gate
from kvcert.evict import H2O
from kvcert.integrations.cache_config import GateConfig, StorageConfig, ValidationConfig, resolve_storage
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random
from kvcert.quant import get


def test_storage_builds_each_layer_a_store_with_its_own_codecs() -> None:
    cfg = StorageConfig("int4", "kivi-2", bands=4, seed=7, write_block=8, device_budget=None)
    a, b = cfg.store(0), cfg.store(1)
    assert (a.layer, b.layer) == (0, 1) and a.key_codec is not b.key_codec
    assert a.key_codec.name == "int4" and a.value_codec.name.startswith("kivi")
    assert (a.bands, a.seed, a.write_block, a.device_budget, a.pairing) == (4, 7, 8, None, "rotate_half")
    shared = get("int8")
    assert StorageConfig(shared, shared, seed=0).store(3).key_codec is shared  # an instance is used as given
    with pytest.raises(ValueError, match="needs a seed"):
        StorageConfig().store(0)


def test_storage_exact_sinks_reach_the_cache_and_keep_the_first_positions_exact() -> None:
    """``StorageConfig(exact_sinks=n)``: every layer's store serves its first ``n`` positions exact (zero residual
    and zero dither step, so zero Tier-A and Tier-B radius) and counts them as exact device entries; ``n = 0`` (the
    default) compresses them. A bad value is refused by name."""
    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    exact = {}
    for sinks in (0, 4):
        cache = CertifiedCache(model, storage=StorageConfig("dither-int4", "int4", seed=1, exact_sinks=sinks))
        model(ids, cache=cache, use_cache=True)
        model(ids[:, :1], cache=cache, use_cache=True)  # the prefill's 40 tokens are encoded (two blocks of 16)
        stores = [layer.store for layer in cache.layers]
        assert all(st.exact_sinks == sinks for st in stores)
        exact[sinks] = [st.k.exact.view()[..., :8] for st in stores]
        for st in stores:
            wit = st.k_wit.view()
            assert bool((wit[..., :sinks] == 0).all()) and bool((wit[..., sinks:8] > 0).all())
            assert st.k_steps is not None and bool((st.k_steps.view()[..., :sinks, :] == 0).all())  # Tier-B radius 0
    assert all(bool(e[..., :4].all()) and not bool(e[..., 4:].any()) for e in exact[4])
    assert not any(bool(e.any()) for e in exact[0])
    with pytest.raises(ValueError, match="exact_sinks"):
        StorageConfig("int8", "int8", seed=0, exact_sinks=-1).store(0)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"keys": 4}, TypeError, "keys must be a codec name, a Codec or a non-empty tuple of them"),
        ({"values": None}, TypeError, "values must be a codec name, a Codec or a non-empty tuple of them"),
        ({"key_options": [("bypass", 4)]}, TypeError, "key_options must be a dict"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": True}, TypeError, "seed must be an int"),
    ],
)
def test_storage_names_a_wrong_type(kw, error, match) -> None:
    with pytest.raises(error, match=match):
        StorageConfig(**kw)


def test_flat_keywords_and_storage_each_set_a_setting_once() -> None:
    flat = resolve_storage(None, "int4", None, 3)
    assert (flat.keys, flat.values, flat.seed) == ("int4", "int8", 3)
    grouped = resolve_storage(StorageConfig("int2", "int4", bands=4), None, None, 5)
    assert (grouped.keys, grouped.values, grouped.bands, grouped.seed) == ("int2", "int4", 4, 5)
    assert resolve_storage(StorageConfig(seed=9), None, None, None).seed == 9
    drawn = {resolve_storage(None, None, None, None).seed for _ in range(4)}
    assert len(drawn) > 1 and all(isinstance(s, int) for s in drawn)  # random per cache
    for keys, values in (("int4", None), (None, "int4"), ("int8", "int8")):
        with pytest.raises(ValueError, match="given both flat and in storage"):
            resolve_storage(StorageConfig(), keys, values, None)
    with pytest.raises(ValueError, match="seed given both flat and in storage"):
        resolve_storage(StorageConfig(seed=1), None, None, 2)
    with pytest.raises(TypeError, match="storage must be a kvcert.StorageConfig"):
        resolve_storage({"keys": "int4"}, None, None, None)  # type: ignore[arg-type]


def test_the_cache_takes_its_groups_and_refuses_a_setting_given_twice_or_a_wrong_type() -> None:
    model = tiny_random("llama", head_dim=32)
    with CertifiedCache(model, storage=StorageConfig("int4", "int2", bands=4), seed=3) as cache:
        assert (cache.key_codec_name, cache.value_codec_name, cache.storage.bands, cache.storage.seed) == (
            "int4",
            "int2",
            4,
            3,
        )
        assert cache.layers[0].store.bands == 4 and not cache.validate and cache.certify
    with CertifiedCache(model, "int4", validation=ValidationConfig(certify=False)) as cache:
        assert not cache.certify and cache.value_codec_name == "int8"
    with pytest.raises(ValueError, match="keys given both flat and in storage"):
        CertifiedCache(model, keys="int4", storage=StorageConfig("int4"))
    bad = [
        ({"storage": {"keys": "int4"}}, "storage must be a kvcert.StorageConfig"),
        ({"validation": {"certify": False}}, "validation must be a kvcert.ValidationConfig"),
        ({"eviction": H2O(recent=2)}, "eviction must be a kvcert.EvictionConfig"),
        ({"gate": "certified"}, "gate must be a kvcert.Gate"),
    ]
    for kw, match in bad:
        with pytest.raises(TypeError, match=match):
            CertifiedCache(model, **kw)
    assert model.config._attn_implementation != "kvcert"  # nothing was attached by a refused construction


def test_the_groups_are_exported_from_kvcert() -> None:
    assert kvcert.StorageConfig is StorageConfig and kvcert.ValidationConfig is ValidationConfig
    assert kvcert.EvictionConfig is kvcert.attention.evict_driver.EvictionConfig
    assert {"StorageConfig", "ValidationConfig", "EvictionConfig"} <= set(kvcert.__all__)


def test_gate_config_picks_the_ladder_only_with_the_gate_off() -> None:
    assert GateConfig.of(None, False, False) == GateConfig(Gate.off())
    ladder = GateConfig.of(None, LadderConfig(k_max=4), True).ladder
    assert ladder == LadderConfig(k_max=4, validate=True)
    assert GateConfig.of(None, True, False).ladder == LadderConfig()
    with pytest.raises(ValueError, match="ladder=True has its own fallback rungs"):
        GateConfig.of(Gate.certified(0.1), True, False)


def test_validation_config_splits_the_request_budget_and_refuses_a_gate_without_certificates() -> None:
    cfg = ValidationConfig(delta_req=1e-2, max_steps=64)
    assert cfg.delta_loc(3, 4) == uniform_split(1e-2, 3, 4, 64) and cfg.certify
    cfg.check(Gate.certified(0.1), True)  # certified: any gate, validate mode
    for gate, validate in ((Gate.certified(0.1), False), (Gate.off(), True)):
        with pytest.raises(ValueError, match="certify=False cannot be combined"):
            ValidationConfig(certify=False).check(gate, validate)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"certify": 0}, TypeError, "certify must be a bool"),
        ({"delta_req": 0.0}, ValueError, "delta_req must lie in"),
        ({"delta_req": 1.5}, ValueError, "delta_req must lie in"),
        ({"delta_req": float("nan")}, ValueError, "delta_req must lie in"),
        ({"max_steps": 0}, ValueError, "max_steps must be a positive int"),
        ({"max_steps": 2.0}, ValueError, "max_steps must be a positive int"),
    ],
)
def test_validation_config_names_a_wrong_argument(kw, error, match) -> None:
    with pytest.raises(error, match=match):
        ValidationConfig(**kw)
