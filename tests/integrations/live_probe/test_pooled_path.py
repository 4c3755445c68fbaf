"""The live pooling path of the probe: meters per (layer, head, step) against brute force, chain, self-checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kvcert.integrations.live_probe.pooled_path as pool_probe
from kvcert.contracts import Tier
from kvcert.integrations.live_probe.heterogeneous import ProbeConfig, probe_request
from kvcert.integrations.live_probe.pooled_path import pooling_meters
from kvcert.integrations.live_probe.request import serve_request
from kvcert.integrations.pooled_attention import PoolingConfig, serve_pooled
from kvcert.models.tiny import tiny_random
from kvcert.probe import verify
from kvcert.quant.rtn import RTNCodec

IDS = torch.randint(0, 128, (1, 22), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def model():
    return tiny_random("llama", seed=3, attn_implementation="sdpa")


def _reading(snap, layer, name):
    (r,) = [r for r in snap.readings if r.layer == layer and r.path == "pooling" and r.name == name]
    return r


@pytest.mark.parametrize("block", [2, 4, 5])
def test_meters_per_layer_head_step_match_brute_force(model, block):
    with serve_pooled(model, PoolingConfig(block=block, codec=RTNCodec(8, group_size=8))) as reads:
        steps = serve_request(model, IDS)
    m = pooling_meters(reads, 2)
    assert m.a_l2_max.shape == (2, steps, 1, 2) and int(m.blocks.sum()) == 2 * (IDS.shape[1] // block)
    for r in reads:
        for h in range(2):
            ws = [r.weights[0, h, i].tolist() for i in range(len(r.new_blocks))]
            if not ws:
                assert math.isnan(float(m.a_l2_max[r.layer, r.step, 0, h]))
                continue
            l2 = [math.sqrt(sum(x * x for x in w)) for w in ws]
            top1 = [(max(w) - 1 / block) / (1 - 1 / block) for w in ws]
            ent = [-sum(x * math.log(x) for x in w if x > 0) for w in ws]
            at = (r.layer, r.step, 0, h)
            assert float(m.a_l2_max[at]) == pytest.approx(max(l2), rel=1e-12)
            assert float(m.a_l2_min[at]) == pytest.approx(min(l2), rel=1e-12)
            assert float(m.top1_norm_max[at]) == pytest.approx(max(top1), rel=1e-9, abs=1e-12)
            assert float(m.entropy_n_min[at]) == pytest.approx(min(e / math.log(block) for e in ent), rel=1e-9)
            assert float(m.eff_frac_min[at]) == pytest.approx(min(math.exp(e) / block for e in ent), rel=1e-9)
            assert 1 / math.sqrt(block) - 1e-12 <= min(l2) and max(l2) <= 1 + 1e-12
            assert int(m.floor_violations[at]) == 0
            assert int(m.blocks[r.layer, r.step]) == len(r.new_blocks)


def test_mean_pooling_sits_on_the_floor(model):
    with serve_pooled(model, PoolingConfig(block=4, weighting="mean")) as reads:
        serve_request(model, IDS)
    m = pooling_meters(reads, 2)
    seen = ~torch.isnan(m.a_l2_max)
    assert torch.allclose(m.a_l2_max[seen], torch.full_like(m.a_l2_max[seen], 0.5))
    assert torch.allclose(m.top1_norm_max[seen], torch.zeros_like(m.a_l2_max[seen]), atol=1e-12)


def test_probe_pooling_readings_chain_and_gate(model):
    res = probe_request(model, IDS, run_id="r", model_name="llama")
    snap, m = res.snapshot, res.pooling
    assert m is not None and verify(snap).ok
    for layer in (0, 1):
        seen = ~torch.isnan(m.a_l2_max[layer])
        coef = _reading(snap, layer, "pool_coef_l2/max")
        assert coef.tier is Tier.CERTIFIED and coef.value == float(m.a_l2_max[layer][seen].max())
        assert _reading(snap, layer, "pool_coef_linf").value == 1.0
        for name in ("pool_top1_norm/max", "pool_entropy_n/min", "pool_eff_frac/min"):
            r = _reading(snap, layer, name)
            assert r.tier is Tier.EMPIRICAL and r.kind == "reading" and 0.0 <= r.value <= 1.0
        (c,) = [c for c in res.chains if c.path == "pooling" and c.layer == layer]
        assert c.chain.names == ("pool_l2", "store_witness", "score_bridge", "softmax_uniform")
        assert c.tier is Tier.CERTIFIED and c.dominant_stage == "store_witness"
        w = _reading(snap, layer, "band_witness").value
        qn = _reading(snap, layer, "qnorm").value
        # pooling acts on exact tokens: its coefficient multiplies a zero error and leaves the store term alone
        assert c.evaluation.value == pytest.approx(0.5 * math.expm1(2 * qn * w), rel=1e-12)
        true = _reading(snap, layer, "true_tv").value
        cert = _reading(snap, layer, "certificates").value
        assert true <= cert <= c.evaluation.value + 1e-12


def test_fine_entries_make_a_non_vacuous_chain(model):
    cfg = ProbeConfig(key_codec=RTNCodec(8, group_size=8))
    res = probe_request(model, IDS, run_id="r", model_name="llama", config=cfg)
    pooled = [c for c in res.chains if c.path == "pooling"]
    assert len(pooled) == 2 and all(c.verdict == "non-vacuous" for c in pooled)


def test_a_floor_violation_reaches_the_gate(model, monkeypatch):
    real = pool_probe.pooling_profile

    def broken(w):
        prof = real(w)
        mask = prof.floor_mask.clone()
        mask.view(-1)[0] = True
        return dataclasses.replace(prof, floor_mask=mask, floor_violations=int(mask.sum()))

    monkeypatch.setattr(pool_probe, "pooling_profile", broken)
    snap = probe_request(model, IDS, run_id="r", model_name="llama").snapshot
    assert snap.self_checks.pooling_floor_violations > 0
    result = verify(snap)
    assert result.stage == "soundness" and any("pooling_floor_violations" in x for x in result.reasons)


def test_a_broken_entry_radius_is_caught(model, monkeypatch):
    real = pool_probe.tier_a_radius
    monkeypatch.setattr(pool_probe, "tier_a_radius", lambda *a, **k: real(*a, **k) * 0.01)
    snap = probe_request(model, IDS, run_id="r", model_name="llama").snapshot
    assert snap.self_checks.witness_violations > 0 and verify(snap).stage == "soundness"


def test_bad_inputs():
    with pytest.raises(ValueError, match="never fired"):
        pooling_meters([], 2)
    model = tiny_random("llama", attn_implementation="sdpa")
    with serve_pooled(model, PoolingConfig(block=4)) as reads:
        serve_request(model, IDS[:, :6])
    with pytest.raises(ValueError, match="layers"):
        pooling_meters(reads, 1)
    with pytest.raises(ValueError, match="no block"):  # 3 tokens never fill a block of 4
        probe_request(model, IDS[:, :3], run_id="r", model_name="m")
