import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.contracts import (
    ATTN_DIST_TV,
    INPUT,
    KV_ENTRY_L2,
    SELECTOR_DIST_TV,
    Chain,
    Contract,
    MetricMismatch,
    PremiseViolation,
    Tier,
    bridges,
    stages,
)
from kvcert.contracts.contract import nonneg_product

SCALE, QN, W, EPS0, RHO, LOST, GAIN = 0.125, 8.0267, 0.55, 0.7027, 2.18, 0.0021, 0.0019


def selection_term() -> Chain:
    return Chain().then(stages.selection_s2(LOST, GAIN)).then(bridges.selector_mass_ratio(RHO))


def right_chain() -> Chain:
    """p78-shaped chain: storage witness -> score bridge -> affine softmax bridge, plus S∘ρ in parallel."""
    return (
        Chain()
        .then(stages.store_witness(W))
        .then(bridges.score_bridge(SCALE, QN))
        .then(bridges.softmax_affine(EPS0))
        .also(selection_term())
    )


# --- typing -------------------------------------------------------------------------------------------


def test_right_chain_is_accepted_and_composes():
    chain = right_chain()
    c = chain.compose()
    a_score, a_soft = SCALE * QN, math.exp(2 * EPS0)
    assert c.m_in == KV_ENTRY_L2 and c.m_out == ATTN_DIST_TV
    assert c.a == pytest.approx(a_score * a_soft, rel=1e-12)
    assert c.b == pytest.approx(a_score * a_soft * W + RHO * 0.5 * (LOST + GAIN), rel=1e-12)
    assert c.tier is Tier.EMPIRICAL  # decided by the empirical ρ stage
    assert c.stages == (
        "store_witness",
        "score_bridge",
        "softmax_affine",
        "(selection_s2 -> selector_mass_ratio)",
    )
    assert "empirical" in str(c)


def test_ill_typed_reference_chain_is_rejected():
    """``docs/contracts.md#chains``: the retracted E1 sum added a relative storage witness to a selector TV."""
    store_rel = stages.relative_store_witness(0.0231)
    select = stages.selection_s2(LOST, GAIN)
    with pytest.raises(MetricMismatch, match="selector_dist:tv@consume.*kv_entry:rel_witness@write"):
        Chain().then(store_rel).also(select)
    with pytest.raises(MetricMismatch, match="kv_entry:rel_witness@write.*selector_dist:tv@consume"):
        Chain().then(select).also(store_rel)
    with pytest.raises(MetricMismatch):  # comp selectC storeC
        Chain().then(store_rel).then(select)
    with pytest.raises(MetricMismatch):  # and the relative witness cannot feed the score bridge either
        Chain().then(store_rel).then(bridges.score_bridge(SCALE, QN))


@pytest.mark.parametrize("m_in", ["attn_logit:linf@write", "attn_logit:l2@consume", "selector_score:linf@consume"])
def test_each_metric_part_blocks_composition(m_in):
    nxt = Contract("next", 1.0, 0.0, 0.0, Tier.CERTIFIED, m_in, "attn_dist:tv@consume", "test")
    with pytest.raises(MetricMismatch):
        Chain().then(bridges.score_bridge(SCALE, QN)).then(nxt)


def test_also_requires_matching_output_metric_only():
    chain = Chain().then(bridges.score_bridge(SCALE, QN)).then(bridges.softmax_tanh())
    assert chain.m_out == ATTN_DIST_TV
    with pytest.raises(MetricMismatch):
        chain.also(stages.selection_s2(LOST, GAIN))  # lands in selector_dist:tv, not attn_dist:tv
    extended = chain.also(bridges.selector_mass_ratio(RHO), e_in=0.01)  # own input metric is free
    assert extended.m_out == ATTN_DIST_TV and len(extended) == 3
    assert extended.compose().b == pytest.approx(RHO * 0.01)


def test_empty_chain_and_bad_arguments():
    with pytest.raises(ValueError, match="empty chain"):
        Chain().compose()
    with pytest.raises(ValueError, match="empty chain"):
        Chain().evaluate(0.0)
    with pytest.raises(ValueError, match="empty chain"):
        Chain().also(stages.store_witness(0.1))
    with pytest.raises(ValueError, match="Contract"):
        Chain().then("score_bridge")  # type: ignore[arg-type]
    chain = Chain().then(stages.store_witness(0.1))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="e_in"):
            chain.evaluate(bad)
    with pytest.raises(ValueError, match="e_in"):
        chain.also(stages.store_witness(0.1), e_in=-0.5)


def test_chain_is_immutable():
    base = Chain().then(stages.store_witness(0.1))
    longer = base.then(bridges.score_bridge(SCALE, QN))
    assert len(base) == 1 and len(longer) == 2 and base.m_out == KV_ENTRY_L2


# --- contract validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("a", {"a": -1.0}),
        ("a", {"a": math.nan}),
        ("b", {"b": math.nan}),
        ("b", {"b": -0.1}),
        ("delta", {"delta": 1.5}),
        ("reason", {"reason": " "}),
        ("name", {"name": ""}),
        ("tier", {"tier": "sound"}),
        ("norm", {"m_in": "kv_entry:l9@write"}),
        ("premise", {"premise": ("only a description",)}),
        ("transfer", {"transfer": 3.0}),
    ],
)
def test_contract_rejects_bad_fields(field, kwargs):
    base = dict(
        name="c",
        a=1.0,
        b=0.0,
        delta=0.0,
        tier="certified",
        m_in="kv_entry:l2@write",
        m_out="kv_entry:l2@write",
        reason="test",
    )
    with pytest.raises(ValueError, match=field):
        Contract(**{**base, **kwargs})


def test_contract_coerces_strings_and_premise_pairs():
    c = Contract("c", 2, 1, 0, "partial", "kv_entry:l2@write", "kv_entry:l2@write", "r", ("e <= 1", lambda e: e <= 1))
    assert c.tier is Tier.PARTIAL and c.m_in == KV_ENTRY_L2 and c.premise.description == "e <= 1"
    assert c.apply(1.0) == 3.0
    with pytest.raises(PremiseViolation, match="e <= 1"):
        c.apply(1.5)


# --- premises -----------------------------------------------------------------------------------------


def test_affine_premise_checked_at_evaluation():
    eps0 = SCALE * QN * W
    chain = Chain().then(stages.store_witness(W)).then(bridges.score_bridge(SCALE, QN))
    ok = chain.then(bridges.softmax_affine(eps0)).evaluate(0.0)
    assert ok.value == pytest.approx(math.exp(2 * eps0) * eps0, rel=1e-12)
    with pytest.raises(PremiseViolation, match="softmax_affine"):
        chain.then(bridges.softmax_affine(eps0 * 0.999)).evaluate(0.0)


def test_parallel_term_premise_checked_when_attached():
    chain = Chain().then(bridges.score_bridge(SCALE, QN))
    term = Contract(
        "clamped",
        1.0,
        0.0,
        0.0,
        "partial",
        SELECTOR_DIST_TV,
        "attn_logit:linf@consume",
        "r",
        ("e <= 0.1", lambda e: e <= 0.1),
    )
    assert chain.also(term, e_in=0.1).compose().b == pytest.approx(0.1)
    with pytest.raises(PremiseViolation):
        chain.also(term, e_in=0.2)


# --- evaluate vs exact transfers (p78 cross-check) ----------------------------------------------------


@settings(deadline=None)
@given(
    w=st.floats(0.0, 2.0),
    scale=st.floats(0.01, 1.0),
    qn=st.floats(0.0, 5.0),
    lost=st.floats(0.0, 1.0),
    gain=st.floats(0.0, 1.0),
    rho=st.floats(0.0, 3.0),
)
def test_evaluate_matches_exact_transfers(w, scale, qn, lost, gain, rho):
    head = Chain().then(stages.store_witness(w)).then(bridges.score_bridge(scale, qn))
    eps = scale * qn * w
    term = Chain().then(stages.selection_s2(lost, gain)).then(bridges.selector_mass_ratio(rho))
    uniform = head.then(bridges.softmax_uniform()).also(term).evaluate(0.0)
    exact = 0.5 * math.expm1(2 * eps) + rho * 0.5 * (lost + gain)
    assert abs(uniform.value - exact) <= 1e-9 * max(1.0, exact)
    tanh = head.then(bridges.softmax_tanh()).evaluate(0.0)
    assert abs(tanh.value - math.tanh(eps)) <= 1e-9
    assert uniform.tier is Tier.EMPIRICAL and tanh.tier is Tier.CERTIFIED
    # every number travels with its stages: the contributions account for the whole value
    assert math.fsum(s.contribution for s in uniform.stages) + uniform.input_contribution == pytest.approx(
        uniform.value, rel=1e-9, abs=1e-12
    )


def test_stage_contributions_and_dominant_stage():
    ev = right_chain().evaluate(0.0)
    a_total = SCALE * QN * math.exp(2 * EPS0)
    by_name = {s.name: s for s in ev.stages}
    assert by_name["store_witness"].contribution == pytest.approx(a_total * W, rel=1e-12)
    assert by_name["score_bridge"].contribution == 0.0 and by_name["softmax_affine"].contribution == 0.0
    term = by_name["(selection_s2 -> selector_mass_ratio)"]
    assert term.parallel and term.contribution == pytest.approx(RHO * 0.5 * (LOST + GAIN), rel=1e-12)
    assert ev.dominant_stage == "store_witness"
    assert ev.stages[2].e_in == pytest.approx(SCALE * QN * W) and ev.stages[-1].e_out == ev.value
    # with a tiny witness the selection term dominates; with only an input error the input does
    tiny = Chain().then(stages.store_witness(1e-6)).then(bridges.score_bridge(SCALE, QN))
    assert (
        tiny.then(bridges.softmax_affine(EPS0))
        .also(selection_term())
        .evaluate(0.0)
        .dominant_stage.startswith("(selection_s2")
    )
    assert Chain().then(bridges.score_bridge(SCALE, QN)).evaluate(0.3).dominant_stage == INPUT


# --- composition algebra ------------------------------------------------------------------------------

affine_stage = st.tuples(st.floats(0.0, 4.0), st.floats(0.0, 3.0), st.floats(0.0, 0.01), st.sampled_from(list(Tier)))


def _affine_chain(params) -> Chain:
    chain = Chain()
    for i, (a, b, delta, tier) in enumerate(params):
        chain = chain.then(Contract(f"s{i}", a, b, delta, tier, KV_ENTRY_L2, KV_ENTRY_L2, "test"))
    return chain


@settings(deadline=None)
@given(st.lists(affine_stage, min_size=1, max_size=7), st.floats(0.0, 5.0))
def test_composition_algebra(params, e_in):
    chain = _affine_chain(params)
    c = chain.compose()
    assert c.a == pytest.approx(math.prod(p[0] for p in params), rel=1e-12, abs=0)
    assert c.delta == pytest.approx(math.fsum(p[2] for p in params), rel=1e-12, abs=0)
    assert c.tier is min(p[3] for p in params)
    expected_b = math.fsum(b * math.prod(p[0] for p in params[i + 1 :]) for i, (_, b, _, _) in enumerate(params))
    assert c.b == pytest.approx(expected_b, rel=1e-9, abs=1e-12)
    ev = chain.evaluate(e_in)
    assert ev.value == pytest.approx(c.bound(e_in), rel=1e-9, abs=1e-12)
    assert ev.delta == c.delta and ev.tier is c.tier
    # per-stage shares of an affine chain are exactly (Π_{j>k} a_j)·b_k
    for k, s in enumerate(ev.stages):
        assert s.contribution == pytest.approx(
            params[k][1] * math.prod(p[0] for p in params[k + 1 :]), rel=1e-9, abs=1e-12
        )


@settings(deadline=None)
@given(st.lists(affine_stage, min_size=2, max_size=6), st.data())
def test_composition_is_associative(params, data):
    cut = data.draw(st.integers(1, len(params) - 1))
    whole = _affine_chain(params).compose()
    nested = Chain().then(_affine_chain(params[:cut]).as_contract()).then(_affine_chain(params[cut:]).as_contract())
    n = nested.compose()
    assert n.a == pytest.approx(whole.a, rel=1e-12, abs=1e-300)
    assert n.b == pytest.approx(whole.b, rel=1e-9, abs=1e-12)
    assert n.delta == pytest.approx(whole.delta, rel=1e-12, abs=0) and n.tier is whole.tier


@settings(deadline=None)
@given(st.lists(affine_stage, min_size=1, max_size=6), st.floats(0.0, 5.0), st.data())
def test_composed_bound_dominates_any_realisation(params, e0, data):
    """Soundness of C1: if every stage meets e_k <= a_k·e_{k-1} + b_k, the end error is <= a·e0 + b."""
    e = e0
    for a, b, _, _ in params:
        e = data.draw(st.floats(0.0, 1.0)) * (a * e + b)
    assert e <= _affine_chain(params).compose().bound(e0) * (1 + 1e-12) + 1e-12


def test_unbounded_slope_and_zero_conventions():
    assert nonneg_product(0.0, math.inf) == 0.0 and nonneg_product(math.inf, 0.0) == 0.0
    assert nonneg_product(2.0, math.inf) == math.inf
    soft = Chain().then(bridges.score_bridge(SCALE, QN)).then(bridges.softmax_uniform()).compose()
    assert soft.a == math.inf and soft.b == 0.0 and soft.bound(0.0) == 0.0
    reset = Contract("reset", 0.0, 0.25, 0.0, "certified", ATTN_DIST_TV, ATTN_DIST_TV, "output ignores input")
    after = Chain().then(bridges.score_bridge(SCALE, QN)).then(bridges.softmax_uniform()).then(reset)
    assert after.compose().a == 0.0 and after.compose().b == 0.25
    assert after.evaluate(0.2).value == 0.25
    dense = Chain().then(stages.store_witness(W)).then(bridges.score_bridge(SCALE, QN)).then(bridges.softmax_uniform())
    nested = dense.as_contract("dense")  # a = b = inf: no affine form, but the exact transfer still evaluates
    assert nested.a == math.inf and nested.b == math.inf
    assert Chain().then(nested).evaluate(0.0).value == pytest.approx(0.5 * math.expm1(2 * SCALE * QN * W), rel=1e-12)


def test_misdeclared_transfer_is_caught():
    """A transfer above the declared affine form would make compose() unsound: refuse it."""
    loose = Contract("loose", 1.0, 0.0, 0.0, "certified", ATTN_DIST_TV, ATTN_DIST_TV, "r", transfer=lambda e: 2 * e)
    assert loose.apply(0.0) == 0.0
    with pytest.raises(ValueError, match="transfer"):
        Chain().then(loose).evaluate(0.1)
    negative = Contract("neg", 1.0, 0.0, 0.0, "certified", ATTN_DIST_TV, ATTN_DIST_TV, "r", transfer=lambda e: -e)
    with pytest.raises(ValueError, match="transfer"):
        negative.apply(0.1)
