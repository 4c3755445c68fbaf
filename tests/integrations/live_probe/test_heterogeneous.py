"""Heterogeneous-memory probe over 8 tiny model configurations from 7 architecture families."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import kvcert.integrations.live_probe.heterogeneous as het
from kvcert.contracts import Tier
from kvcert.integrations.forget_gates import tiny_recurrent_model
from kvcert.integrations.live_probe.heterogeneous import ProbeConfig, memory_paths, probe_request
from kvcert.integrations.mla import tiny_deepseek_v3
from kvcert.models.tiny import SLIDING_SHAPES, tiny_random
from kvcert.probe import ProbeSnapshot, verify
from kvcert.quant.rtn import RTNCodec

IDS = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(5))

DENSE = ("dense_kv", "sparse_selector", "pooling")


def _dense(family: str):
    """The tiny ``family`` model (SDPA; Mistral and Gemma-3 in their sliding-window shapes), built on call."""
    return lambda: tiny_random(family, attn_implementation="sdpa", **SLIDING_SHAPES.get(family, {}))


CONFIGS = {
    "llama": (_dense("llama"), DENSE),
    "qwen2": (_dense("qwen2"), DENSE),
    "mistral-swa": (_dense("mistral"), ("dense_kv", "sparse_selector")),  # nothing to pool
    "gemma3-sliding+global": (_dense("gemma3"), DENSE),
    "deepseek_v3-mla": (lambda: tiny_deepseek_v3(), ("latent_kv",)),
    "deepseek_v3-mla-qlora": (lambda: tiny_deepseek_v3(q_lora_rank=16), ("latent_kv",)),
    "mamba2": (lambda: tiny_recurrent_model("mamba2"), ("recurrent",)),
    "qwen3_next-gdn+attn": (lambda: tiny_recurrent_model("qwen3_next"), ("recurrent", *DENSE)),
}
EXPECTED_TIER = {
    "dense_kv": Tier.CERTIFIED,
    "latent_kv": Tier.CERTIFIED,
    "sparse_selector": Tier.EMPIRICAL,
    "recurrent": Tier.EMPIRICAL,
    "pooling": Tier.CERTIFIED,
}


@pytest.fixture(scope="module")
def models():
    return {name: make() for name, (make, _) in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_probe_passes_gate_with_chains(models, name):
    model = models[name]
    res = probe_request(model, IDS, run_id=f"run-{name}", model_name=name)
    snap = res.snapshot
    assert snap.declared.paths == CONFIGS[name][1] == memory_paths(model)
    assert snap.declared.layers == (0, 1)
    assert snap.self_checks.to_dict() == {
        "witness_violations": 0,
        "certified_flips": 0,
        "pooling_floor_violations": 0,
    }
    result = verify(snap)
    assert result.ok, result.reasons
    # every (layer, path) that has readings has one chain, with the tier its stages decide
    keyed = {(r.layer, r.path) for r in snap.readings}
    assert {(c.layer, c.path) for c in res.chains} == keyed
    for c in res.chains:
        assert c.tier is EXPECTED_TIER[c.path]
        names = {s.name for s in c.evaluation.stages} | {"input"}
        assert c.dominant_stage in names
        if c.tier is Tier.EMPIRICAL:
            assert c.verdict is None
        else:
            assert c.verdict == (
                "non-vacuous" if c.evaluation.value < 0.5 else "marginal" if c.evaluation.value < 1 else "saturated"
            )
    # JSON round trip keeps the gate verdict
    again = ProbeSnapshot.from_json(snap.to_json())
    assert verify(again).ok


def _reading(snap, layer, path, name):
    (r,) = [r for r in snap.readings if r.layer == layer and r.path == path and r.name == name]
    return r


def test_dense_chain_comes_from_the_live_cache_readings(models):
    res = probe_request(models["qwen2"], IDS, run_id="r", model_name="qwen2")
    dense = [c for c in res.chains if c.path == "dense_kv"]
    assert [c.layer for c in dense] == [0, 1]
    for c in dense:
        assert c.chain.names == ("store_witness", "score_bridge", "logit_rounding", "softmax_uniform")
        witness = _reading(res.snapshot, c.layer, c.path, "band_witness")
        qnorm = _reading(res.snapshot, c.layer, c.path, "qnorm")
        slack = _reading(res.snapshot, c.layer, c.path, "logit_slack")
        assert witness.kind == slack.kind == "bound" and qnorm.kind == "reading"  # a coefficient is no bound
        w, qn, phi = witness.value, qnorm.value, slack.value  # qn = scale·max‖q‖
        assert c.evaluation.value == pytest.approx(0.5 * math.expm1(2 * (qn * w + phi)), rel=1e-9)
        # the per-cell certificate is never looser than the layer chain, which bounds the worst cell
        cert = _reading(res.snapshot, c.layer, c.path, "certificates").value
        true = _reading(res.snapshot, c.layer, c.path, "true_tv")
        assert true.kind == "reading" and true.value <= cert <= min(1.0, c.evaluation.value) + 1e-12


def test_hybrid_dense_layers_fall_back_to_captured_keys(models):
    res = probe_request(models["qwen3_next-gdn+attn"], IDS, run_id="r", model_name="q3n")
    (c,) = [c for c in res.chains if c.path == "dense_kv"]
    assert c.layer == 1 and c.chain.names == ("store_witness", "score_bridge", "softmax_uniform")
    w = _reading(res.snapshot, 1, "dense_kv", "band_witness").value
    qn = _reading(res.snapshot, 1, "dense_kv", "qnorm").value
    assert c.evaluation.value == pytest.approx(0.5 * math.expm1(2 * qn * w), rel=1e-9)


def test_selector_chain_adds_the_selection_term(models):
    res = probe_request(models["llama"], IDS, run_id="r", model_name="llama")
    for c in res.chains:
        if c.path == "sparse_selector":
            w = _reading(res.snapshot, c.layer, c.path, "band_witness").value
            qn = _reading(res.snapshot, c.layer, c.path, "qnorm").value
            rho = _reading(res.snapshot, c.layer, c.path, "sel_bridge_rho").value
            lost = _reading(res.snapshot, c.layer, c.path, "lost_mass").value
            gain = _reading(res.snapshot, c.layer, c.path, "gain_mass").value
            assert c.evaluation.value == pytest.approx(
                0.5 * math.expm1(2 * qn * w) + rho * 0.5 * (lost + gain), rel=1e-12
            )


def test_latent_tier_b_reading_present(models):
    snap = probe_request(models["deepseek_v3-mla"], IDS, run_id="r", model_name="mla").snapshot
    for layer in (0, 1):
        tb = _reading(snap, layer, "latent_kv", "latent_tier_b")
        ta = _reading(snap, layer, "latent_kv", "certificates")
        assert tb.tier is Tier.PARTIAL and tb.kind == "bound" and 0 <= tb.value <= 1
        assert ta.tier is Tier.CERTIFIED


def _tampered(snap: ProbeSnapshot, **changes) -> ProbeSnapshot:
    return dataclasses.replace(snap, **changes)


def test_tampered_snapshots_fail(models):
    snap = probe_request(models["llama"], IDS, run_id="r", model_name="llama").snapshot
    bad = _tampered(snap, self_checks=dataclasses.replace(snap.self_checks, certified_flips=1))
    assert verify(bad).stage == "soundness"
    bad = _tampered(snap, readings=tuple(r for r in snap.readings if r.layer != 1))
    assert verify(bad).stage == "coverage"
    bad = _tampered(snap, triggers=0)
    assert verify(bad).stage == "coverage"
    data = json.loads(snap.to_json())
    data["readings"][0]["value"] = float("nan")
    bad = ProbeSnapshot.from_json(json.dumps(data))
    assert verify(bad).stage == "magnitude"


def test_a_broken_radius_is_caught_by_the_self_check(models, monkeypatch):
    real = het.tier_a_radius
    monkeypatch.setattr(het, "tier_a_radius", lambda *a, **k: real(*a, **k) * 0.01)
    snap = probe_request(models["qwen2"], IDS, run_id="r", model_name="qwen2").snapshot
    assert snap.self_checks.witness_violations > 0
    assert verify(snap).stage == "soundness"


def test_a_broken_margin_certificate_is_caught(models, monkeypatch):
    real = het.rank_prefix_certificate
    monkeypatch.setattr(het, "rank_prefix_certificate", lambda s, v, e, r: real(s, v, e * 0.0, r))
    cfg = ProbeConfig(selector_codec=RTNCodec(2, group_size=8))  # coarse indexer: its top-r often differs
    snap = probe_request(models["llama"], IDS, run_id="r", model_name="llama", config=cfg).snapshot
    assert snap.self_checks.certified_flips > 0
    assert not verify(snap).ok


def test_bad_inputs(models):
    with pytest.raises(ValueError, match="one request"):
        probe_request(models["llama"], IDS.expand(2, -1), run_id="r", model_name="m")
    with pytest.raises(ValueError, match="T >= 2"):
        probe_request(models["llama"], IDS[:, :1], run_id="r", model_name="m")
    with pytest.raises(ValueError, match="block"):
        ProbeConfig(pool_block=0)
    with pytest.raises(ValueError, match="pool_weighting"):
        ProbeConfig(pool_block=None, pool_weighting="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no supported memory class"):
        memory_paths(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="ranks"):
        ProbeConfig(top_k=2, ranks=(3,))
