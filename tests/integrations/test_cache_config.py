"""CertifiedCache's keyword groups: each builds what the keywords say and names the argument at fault."""

from __future__ import annotations

import pytest

from kvcert.attention.ladder import LadderConfig
from kvcert.bounds import uniform_split
from kvcert.cache.gate import Gate
from kvcert.integrations.cache_config import GateConfig, StorageConfig, ValidationConfig
from kvcert.quant import get


def test_storage_builds_each_layer_a_store_with_its_own_codecs() -> None:
    cfg = StorageConfig("int4", "kivi-2", bands=4, seed=7, write_block=8, device_budget=None)
    a, b = cfg.store(0), cfg.store(1)
    assert (a.layer, b.layer) == (0, 1) and a.key_codec is not b.key_codec
    assert a.key_codec.name == "int4" and a.value_codec.name.startswith("kivi")
    assert (a.bands, a.seed, a.write_block, a.device_budget, a.pairing) == (4, 7, 8, None, "rotate_half")
    shared = get("int8")
    assert StorageConfig(shared, shared).store(3).key_codec is shared  # an instance is used as given


def test_gate_config_picks_the_ladder_only_with_the_gate_off() -> None:
    assert GateConfig.of(None, False, False) == GateConfig(Gate.off())
    ladder = GateConfig.of(None, LadderConfig(k_max=4), True).ladder
    assert ladder == LadderConfig(k_max=4, validate=True)
    assert GateConfig.of(None, True, False).ladder == LadderConfig()
    with pytest.raises(ValueError, match="ladder=True has its own fallback rungs"):
        GateConfig.of(Gate.certified(0.1), True, False)


def test_validation_config_splits_the_request_budget_and_refuses_a_gate_without_certificates() -> None:
    cfg = ValidationConfig.of(True, True, Gate.off(), 1e-2, 64, 3, 4)
    assert cfg.delta_loc == uniform_split(1e-2, 3, 4, 64) and cfg.validate and cfg.certify
    for gate, validate in ((Gate.certified(0.1), False), (Gate.off(), True)):
        with pytest.raises(ValueError, match="certify=False cannot be combined"):
            ValidationConfig.of(False, validate, gate, 1e-2, 64, 3, 4)
