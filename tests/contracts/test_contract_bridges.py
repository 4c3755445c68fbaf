import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.contracts import (
    ATTN_DIST_TV,
    ATTN_LOGIT_LINF,
    KV_ENTRY_L2,
    SELECTOR_DIST_TV,
    PremiseViolation,
    Tier,
    bridges,
    stages,
)


def _softmax(s: np.ndarray) -> np.ndarray:
    z = np.exp(s - s.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def test_score_bridge_is_cauchy_schwarz_per_cell():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(32, 64)) * rng.uniform(0.1, 3.0, size=(32, 1))
    dk = rng.normal(size=(128, 64)) * rng.uniform(0.0, 0.5, size=(128, 1))
    dk[:4] = q[:4] / np.linalg.norm(q[:4], axis=1, keepdims=True) * 0.3  # aligned: near-tight cells
    scale = 64**-0.5
    c = bridges.score_bridge(scale, float(np.linalg.norm(q, axis=1).max()))
    assert (c.m_in, c.m_out, c.tier, c.b, c.delta) == (KV_ENTRY_L2, ATTN_LOGIT_LINF, Tier.CERTIFIED, 0.0, 0.0)
    ds = np.abs(scale * q @ dk.T)  # [query, key] score perturbation, every cell
    bound = c.a * np.linalg.norm(dk, axis=1)[None, :]
    assert np.all(ds <= bound * (1 + 1e-12))
    assert c.apply(0.3) == pytest.approx(scale * np.linalg.norm(q, axis=1).max() * 0.3)


def test_softmax_bridges_per_cell():
    rng = np.random.default_rng(1)
    for eps in (1e-4, 0.05, 0.3, 1.0, 3.0):
        s = rng.normal(size=(400, 33)) * rng.uniform(0.0, 6.0, size=(400, 1))
        delta = rng.uniform(-eps, eps, size=s.shape)
        delta[:100] = np.where(rng.random((100, 33)) < 0.5, -eps, eps)  # extreme points of the ℓ∞ ball
        linf = np.abs(delta).max(axis=1)
        tv = 0.5 * np.abs(_softmax(s) - _softmax(s + delta)).sum(axis=1)
        for bridge in (bridges.softmax_uniform(), bridges.softmax_tanh()):
            bound = np.array([bridge.apply(float(e)) for e in linf])
            assert np.all(tv <= bound + 1e-12), bridge.name


@settings(deadline=None)
@given(st.floats(0.0, 20.0))
def test_transfer_never_exceeds_the_affine_form(eps):
    for bridge in (bridges.softmax_uniform(), bridges.softmax_tanh()):
        assert bridge.apply(eps) <= bridge.affine(eps) * (1 + 1e-12) + 1e-15
    assert bridges.tv_tanh(eps) <= bridges.tv_uniform(eps) + 1e-15
    assert bridges.tv_tanh(eps) < 1.0 or eps > 18  # tanh rounds to 1.0 in float64 for large eps


@settings(deadline=None)
@given(eps0=st.floats(0.0, 5.0), frac=st.floats(0.0, 1.0))
def test_affine_relaxation_holds_on_its_premise(eps0, frac):
    eps = eps0 * frac
    c = bridges.softmax_affine(eps0)
    assert bridges.tv_uniform(eps) <= c.apply(eps) * (1 + 1e-12) + 1e-300
    assert c.a == pytest.approx(math.exp(2 * eps0)) and c.tier is Tier.PARTIAL
    assert (c.m_in, c.m_out) == (ATTN_LOGIT_LINF, ATTN_DIST_TV)


def test_affine_premise_violation_and_bad_eps0():
    c = bridges.softmax_affine(0.5)
    assert c.apply(0.5) == pytest.approx(math.e * 0.5)
    with pytest.raises(PremiseViolation, match="eps0"):
        c.apply(math.nextafter(0.5, 1.0))
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="eps0"):
            bridges.softmax_affine(bad)
    with pytest.raises(ValueError, match="eps0"):
        bridges.softmax_affine(400.0)


def test_exact_transfer_values_and_overflow():
    assert bridges.tv_uniform(0.0) == 0.0 and bridges.tv_tanh(0.0) == 0.0
    assert bridges.tv_uniform(math.log(3) / 2) == pytest.approx(1.0, rel=1e-15)
    assert bridges.tv_uniform(1e4) == math.inf
    for fn in (bridges.tv_uniform, bridges.tv_tanh):
        with pytest.raises(ValueError, match="eps"):
            fn(-1e-3)


def test_selector_mass_ratio_is_empirical():
    c = bridges.selector_mass_ratio(2.18, measured_on="truncation sets", applied_to="swap sets")
    assert (c.a, c.b, c.tier, c.m_in, c.m_out) == (2.18, 0.0, Tier.EMPIRICAL, SELECTOR_DIST_TV, ATTN_DIST_TV)
    assert "not a confidence bound" in c.reason and "truncation sets" in c.reason
    with pytest.raises(ValueError, match="measured_ratio"):
        bridges.selector_mass_ratio(-1.0)


@pytest.mark.parametrize(("scale", "qn", "arg"), [(-1.0, 1.0, "scale"), (1.0, math.nan, "max_q_norm")])
def test_score_bridge_rejects_bad_arguments(scale, qn, arg):
    with pytest.raises(ValueError, match=arg):
        bridges.score_bridge(scale, qn)


def test_local_stage_contracts():
    w = stages.store_witness(0.7)
    assert (w.a, w.b, w.tier, w.m_in, w.m_out) == (1.0, 0.7, Tier.CERTIFIED, KV_ENTRY_L2, KV_ENTRY_L2)
    s = stages.selection_s2(0.004, 0.002)
    assert (s.a, s.b, s.tier, s.m_in) == (1.0, pytest.approx(0.003), Tier.PARTIAL, SELECTOR_DIST_TV)
    assert stages.relative_store_witness(0.02).m_out.norm == "rel_witness"
    with pytest.raises(ValueError, match="witness"):
        stages.store_witness(-0.1)
    with pytest.raises(ValueError, match="lost_mass"):
        stages.selection_s2(1.5, 0.0)
