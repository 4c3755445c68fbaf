import math

import pytest

from kvcert.contracts import (
    ATTN_DIST_TV,
    KV_ENTRY_L2,
    Bound,
    Chain,
    Reading,
    Tier,
    Verdict,
    as_bound,
    as_reading,
    bridges,
    format_bound,
    stages,
    tv_verdict,
    tv_verdict_of,
)


@pytest.mark.parametrize(
    ("value", "verdict"),
    [
        (0.0, Verdict.NON_VACUOUS),
        (math.nextafter(0.5, 0.0), Verdict.NON_VACUOUS),
        (0.5, Verdict.MARGINAL),
        (math.nextafter(1.0, 0.0), Verdict.MARGINAL),
        (1.0, Verdict.SATURATED),
        (36.3, Verdict.SATURATED),
        (math.inf, Verdict.SATURATED),
    ],
)
def test_verdict_thresholds_at_the_boundaries(value, verdict):
    assert tv_verdict(value) is verdict
    assert Bound(value, ATTN_DIST_TV, Tier.CERTIFIED).verdict is verdict


@pytest.mark.parametrize("bad", [math.nan, -1e-9])
def test_verdict_rejects_non_bounds(bad):
    with pytest.raises(ValueError, match="value"):
        tv_verdict(bad)


def test_diagnostic_readings_cannot_be_printed_as_bounds():
    reading = Reading(0.647, ATTN_DIST_TV, Tier.PARTIAL, "mean query-norm coefficient")
    with pytest.raises(TypeError, match="diagnostic readings have no bound semantics"):
        format_bound(reading)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Bounds only"):
        tv_verdict_of(reading)  # type: ignore[arg-type]
    assert not hasattr(reading, "verdict")
    text = str(reading)
    assert text.startswith("diagnostic reading 0.647") and "bound" not in text and "vacuous" not in text
    bound = Bound(0.786, ATTN_DIST_TV, Tier.PARTIAL)
    assert format_bound(bound).startswith("bound 0.786") and "marginal" in format_bound(bound)
    assert tv_verdict_of(bound) is Verdict.MARGINAL


def test_empirical_values_are_never_bounds():
    with pytest.raises(ValueError, match="tier"):
        Bound(0.1, ATTN_DIST_TV, Tier.EMPIRICAL)
    chain = Chain().then(bridges.score_bridge(0.1, 1.0)).then(bridges.softmax_uniform())
    empirical = chain.also(bridges.selector_mass_ratio(2.0), e_in=0.001)
    with pytest.raises(ValueError, match="tier"):
        as_bound(empirical.evaluate(0.5))
    r = as_reading(empirical.evaluate(0.5), "selector ratio is a measurement")
    assert r.tier is Tier.EMPIRICAL and r.value == pytest.approx(0.5 * math.expm1(0.1) + 0.002)
    b = as_bound(chain.evaluate(0.5))
    assert b.tier is Tier.CERTIFIED and b.value == pytest.approx(0.5 * math.expm1(0.1))


def test_bound_validation():
    with pytest.raises(ValueError, match="value"):
        Bound(math.nan, ATTN_DIST_TV, Tier.CERTIFIED)
    with pytest.raises(ValueError, match="delta"):
        Bound(0.1, ATTN_DIST_TV, Tier.CERTIFIED, delta=2.0)
    with pytest.raises(ValueError, match="TV-valued"):
        _ = Bound(0.1, KV_ENTRY_L2, Tier.CERTIFIED).verdict
    assert "certified" in str(Bound(0.1, KV_ENTRY_L2, "certified")) and "vacuous" not in str(
        Bound(0.1, KV_ENTRY_L2, "certified")
    )
    with pytest.raises(ValueError, match="note"):
        Reading(0.1, ATTN_DIST_TV, Tier.PARTIAL, "")
    assert stages.store_witness(0.1).tier is Tier.CERTIFIED
