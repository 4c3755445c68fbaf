"""The dense-KV chain built from a CertifiedCache run's live telemetry: sound per cell, typed, fail-closed."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert import StorageConfig
from kvcert.cache.telemetry import ChainInputs
from kvcert.contracts import Chain, MetricMismatch, Tier, bridges, stages
from kvcert.integrations.live_probe.dense import dense_chains
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

IDS = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _run(keys: str, **kwargs) -> CertifiedCache:
    """Prefill 8 tokens, then teacher-forced decode of 8 more (every decode read sees compressed keys)."""
    model = tiny_random("llama", head_dim=32)
    storage = StorageConfig(keys=keys, values="int8", write_block=1, seed=1)
    cache = CertifiedCache(model, validate=True, storage=storage, **kwargs)
    with torch.no_grad():
        model(IDS[:, :8], cache=cache, use_cache=True)
        for t in range(8, IDS.shape[1]):
            model(IDS[:, t : t + 1], cache=cache, use_cache=True)
    cache.detach()
    return cache


@pytest.fixture(scope="module", params=["int8", "int4", "dither-int8"])
def run(request):
    return _run(request.param)


def test_chain_bounds_the_true_tv_of_every_cell_of_its_layer(run):
    tel = run.telemetry()
    chains = dense_chains(tel)
    assert [c.layer for c in chains] == [0, 1]
    for c in chains:
        rec = tel.recorded[:, c.layer]
        true = tel.true_tv[:, c.layer][rec]
        cert = tel.certificates[:, c.layer][rec]
        assert true.numel() == 8 * 2 * 4  # decode steps x rows x query heads: every cell is compared
        assert c.evaluation.value >= float(true.max())  # per-cell max, not an average
        assert float(cert.max()) <= c.evaluation.value + 1e-12  # per-token Tier-A radii are never looser
        assert c.evaluation.value < 0.5 and c.verdict == "non-vacuous"  # the comparison is not vacuous
        assert c.tier is Tier.CERTIFIED and c.dominant_stage == "store_witness"
        assert c.chain.names == ("store_witness", "score_bridge", "logit_rounding", "softmax_uniform")
        w, q, phi = (float(x[:, c.layer][rec].max()) for x in (tel.witness, tel.qnorm, tel.logit_slack))
        assert c.evaluation.value == pytest.approx(0.5 * math.expm1(2 * (q * w + phi)), rel=1e-12)


def test_live_witness_reading_matches_the_store(run):
    tel = run.telemetry()
    for layer in (0, 1):
        store = run.layers[layer].store
        band = store.k_wit.view().to(torch.float64)  # [B, Hkv, S]
        assert bool((band >= store.k_band.view().to(torch.float64).sum(-1)).all())  # W_t >= Σ_b ρ_tb
        resid = (store.k.served.view().to(torch.float64) - store.k.host.view().to(torch.float64)).norm(dim=-1)
        reading = tel.witness[:, layer][tel.recorded[:, layer]]
        assert float(reading.max()) == float(band.max())  # the last read sees every stored token
        assert float(reading.max()) >= float(resid.max())  # W >= ‖Δk‖ for every stored token
        # per (row, query head): the KV head's own witness (GQA: 2 query heads per KV head)
        last = tel.witness[-1, layer]
        assert torch.equal(last, band.amax(-1).repeat_interleave(2, dim=1))
        assert bool((tel.qnorm[:, layer][tel.recorded[:, layer]] > 0).all())
        assert bool((tel.logit_slack[:, layer][tel.recorded[:, layer]] > 0).all())


def test_an_understated_witness_is_caught_by_the_true_tv(monkeypatch):
    real = ChainInputs.readings

    def understated(self):
        out = real(self)
        out["witness"] = out["witness"] * 0.01
        return out

    monkeypatch.setattr(ChainInputs, "readings", understated)
    tel = _run("int4").telemetry()
    worst = [float(tel.true_tv[:, c.layer].nan_to_num(0.0).max()) - c.evaluation.value for c in dense_chains(tel)]
    assert max(worst) > 0  # the soundness comparison above can fail


def test_chain_is_typed_and_rejects_mismatched_metrics(run):
    chain = dense_chains(run.telemetry())[0].chain
    with pytest.raises(MetricMismatch, match="selector_dist:tv@consume"):
        chain.then(stages.selection_s2(0.01, 0.01))  # a selector TV term cannot be chained onto attention TV
    with pytest.raises(MetricMismatch, match="kv_entry:rel_witness@write"):
        Chain().then(stages.relative_store_witness(0.02)).then(bridges.score_bridge(1.0, 2.0))
    with pytest.raises(MetricMismatch):
        chain.also(stages.store_witness(0.1))  # an entry-space term cannot be added to a TV


def test_bad_inputs_fail_closed():
    with pytest.raises(ValueError, match="Telemetry"):
        dense_chains({"certificates": None})  # type: ignore[arg-type]
    ladder = _run("int4", ladder=True).telemetry()
    assert ladder.cells > 0 and ladder.witness is None
    with pytest.raises(ValueError, match="ladder"):
        dense_chains(ladder)
