"""Pooling (Lemma P1, both forms) and float32 logit-rounding stages: typing and brute-force soundness."""

import math

import numpy as np
import pytest

from kvcert.contracts import (
    ATTN_DIST_TV,
    ATTN_LOGIT_LINF,
    KV_BLOCK_L2,
    KV_BLOCK_LINF,
    KV_ENTRY_L2,
    Chain,
    MetricMismatch,
    Tier,
    bridges,
    stages,
)


@pytest.mark.parametrize("seed", range(20))
def test_both_pool_forms_bound_the_pooled_entry_error_per_block(seed):
    rng = np.random.default_rng(seed)
    block, dim = int(rng.integers(1, 9)), int(rng.integers(1, 7))
    w = rng.dirichlet(np.full(block, 0.3))  # often concentrated blocks
    delta = rng.normal(size=(block, dim)) * rng.exponential(size=(block, 1))
    err = float(np.linalg.norm(w @ delta))  # ‖Δc‖ of c = Σ_j w_j x_j
    tok = np.linalg.norm(delta, axis=1)
    l2 = stages.pool_l2(float(np.linalg.norm(w)))
    linf = stages.pool_linf()
    assert err <= l2.apply(float(np.sqrt((tok**2).sum()))) * (1 + 1e-12)
    assert err <= linf.apply(float(tok.max())) * (1 + 1e-12)


def test_pool_stage_types_and_tiers():
    l2, linf = stages.pool_l2(0.5), stages.pool_linf()
    assert (l2.a, l2.b, l2.tier, l2.m_in, l2.m_out) == (0.5, 0.0, Tier.CERTIFIED, KV_BLOCK_L2, KV_ENTRY_L2)
    assert (linf.a, linf.b, linf.tier, linf.m_in, linf.m_out) == (1.0, 0.0, Tier.CERTIFIED, KV_BLOCK_LINF, KV_ENTRY_L2)
    # pooling on uncompressed tokens (e_in = 0) then a quantised store: the pool coefficient does not scale b_store
    chain = (
        Chain()
        .then(l2)
        .then(stages.store_witness(0.2))
        .then(bridges.score_bridge(0.25, 4.0))
        .then(bridges.softmax_uniform())
    )
    ev = chain.evaluate(0.0)
    assert ev.value == pytest.approx(0.5 * math.expm1(2 * 0.2)) and ev.dominant_stage == "store_witness"
    assert chain.evaluate(0.3).value == pytest.approx(0.5 * math.expm1(2 * (0.5 * 0.3 + 0.2)))
    with pytest.raises(MetricMismatch, match="kv_block:linf@write"):
        Chain().then(stages.store_witness(0.2)).then(linf)  # a stored entry is not a block of token errors
    with pytest.raises(ValueError, match="coefficient"):
        stages.pool_l2(1.5)
    with pytest.raises(ValueError, match="coefficient"):
        stages.pool_l2(0.0)


def test_logit_rounding_is_an_additive_logit_stage():
    r = stages.logit_rounding(1e-6)
    assert (r.a, r.b, r.tier, r.m_in, r.m_out) == (1.0, 1e-6, Tier.CERTIFIED, ATTN_LOGIT_LINF, ATTN_LOGIT_LINF)
    chain = (
        Chain()
        .then(stages.store_witness(0.1))
        .then(bridges.score_bridge(1.0, 2.0))
        .then(r)
        .then(bridges.softmax_uniform())
    )
    assert chain.m_out == ATTN_DIST_TV
    assert chain.evaluate(0.0).value == pytest.approx(0.5 * math.expm1(2 * (0.2 + 1e-6)), rel=1e-12)
    with pytest.raises(MetricMismatch):
        Chain().then(stages.store_witness(0.1)).then(r)  # rounding acts on logits, not on entries
    with pytest.raises(ValueError, match="logit_rounding"):
        stages.logit_rounding(-1.0)
