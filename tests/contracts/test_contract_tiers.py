import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.contracts import Tier, weakest


def test_order():
    assert Tier.EMPIRICAL < Tier.PARTIAL < Tier.CERTIFIED
    assert Tier.CERTIFIED > Tier.PARTIAL > Tier.EMPIRICAL
    assert Tier.PARTIAL <= Tier.PARTIAL and Tier.PARTIAL >= Tier.PARTIAL
    assert sorted([Tier.CERTIFIED, Tier.EMPIRICAL, Tier.PARTIAL]) == [
        Tier.EMPIRICAL,
        Tier.PARTIAL,
        Tier.CERTIFIED,
    ]


def test_weakest_examples():
    assert weakest(Tier.CERTIFIED) is Tier.CERTIFIED
    assert weakest(Tier.CERTIFIED, Tier.PARTIAL) is Tier.PARTIAL
    assert weakest(Tier.CERTIFIED, Tier.PARTIAL, Tier.EMPIRICAL, Tier.CERTIFIED) is Tier.EMPIRICAL
    assert weakest("certified", "partial") is Tier.PARTIAL


@settings(deadline=None)
@given(st.lists(st.sampled_from(list(Tier)), min_size=1, max_size=8))
def test_weakest_never_upgrades(tiers):
    w = weakest(*tiers)
    assert w in tiers
    assert all(w <= t for t in tiers)


def test_parse_and_errors():
    assert Tier.parse("empirical") is Tier.EMPIRICAL
    with pytest.raises(ValueError, match="tier"):
        Tier.parse("measured")
    with pytest.raises(ValueError, match="tiers"):
        weakest()
