"""The heterogeneous probe on the real SmolLM2-135M-Instruct: live dense chain and pooled path on 30 layers."""

from __future__ import annotations

import pytest
import torch

from kvcert.contracts import Tier
from kvcert.integrations.live_probe.heterogeneous import ProbeConfig, probe_request
from kvcert.probe import verify
from kvcert.quant.rtn import RTNCodec

pytestmark = pytest.mark.real_model

PROMPT = "The quick brown fox jumps over the lazy dog. In a hole in the ground there lived a hobbit."


@pytest.fixture(scope="module")
def probed(smollm2_model):
    model, tok = smollm2_model
    ids = tok(PROMPT, return_tensors="pt").input_ids[:, :16]
    cfg = ProbeConfig(key_codec=RTNCodec(8, group_size=8))
    return probe_request(model, ids, run_id="smollm2", model_name="smollm2-135m", config=cfg)


def test_gate_passes_on_every_layer_and_path(probed):
    snap = probed.snapshot
    assert snap.declared.layers == tuple(range(30))
    assert snap.declared.paths == ("dense_kv", "sparse_selector", "pooling")
    assert verify(snap).ok and snap.self_checks.to_dict() == dict.fromkeys(snap.self_checks.to_dict(), 0)
    assert {(c.layer, c.path) for c in probed.chains} == {(i, p) for i in range(30) for p in snap.declared.paths}


@pytest.mark.parametrize("path", ["dense_kv", "pooling"])
def test_certified_chains_bound_the_worst_cell_of_every_layer(probed, path):
    true = {r.layer: r.value for r in probed.snapshot.readings if r.path == path and r.name == "true_tv"}
    chains = [c for c in probed.chains if c.path == path]
    assert len(chains) == 30 and all(c.tier is Tier.CERTIFIED for c in chains)
    assert all(c.evaluation.value >= true[c.layer] for c in chains)
    assert sum(c.verdict == "non-vacuous" for c in chains) >= 3  # int8 keys: some layers are informative
    if path == "pooling":
        m = probed.pooling
        seen = ~torch.isnan(m.a_l2_max)
        assert bool(seen.any()) and float(m.a_l2_max[seen].max()) <= 1 and float(m.a_l2_min[seen].min()) >= 0.5
