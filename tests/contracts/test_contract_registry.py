import pytest

from kvcert.contracts import (
    REGISTRY,
    ReferenceRequired,
    Tier,
    TierRegistry,
    UnregisteredMetric,
    check_bound_input,
    check_emittable,
    emit,
)
from kvcert.contracts.registry import BUILTIN


def test_unregistered_metric_is_a_hard_error():
    with pytest.raises(UnregisteredMetric, match="not_a_meter"):
        emit("not_a_meter", 0.1)
    with pytest.raises(UnregisteredMetric):
        check_emittable("certificate")  # near miss of 'certificates'
    with pytest.raises(UnregisteredMetric):
        check_bound_input("not_a_meter")


def test_emission_carries_the_registered_tier():
    e = emit("certificates", 0.03)
    assert (e.name, e.value, e.tier) == ("certificates", 0.03, Tier.CERTIFIED) and e.reason
    assert emit("sel_bridge_rho", 0.87).tier is Tier.EMPIRICAL
    assert emit("topk_margin_cert_rate", 0.9).tier is Tier.PARTIAL


def test_reference_requiring_inputs_are_rejected_as_bound_inputs():
    for name in ("true_tv", "true_residual", "true_out_err", "true_int8"):
        assert check_emittable(name).requires_reference  # may be reported (validate mode) ...
        with pytest.raises(ReferenceRequired, match=name):  # ... but never feed a bound
            check_bound_input(name)
    assert check_bound_input("band_witness").tier is Tier.CERTIFIED


def test_registry_covers_every_memory_class_with_tier_and_reason():
    names = set(REGISTRY.names())
    assert {"band_witness", "latent_witness", "sel_bS", "gate_sum_log_a", "pool_top1_norm"} <= names
    assert {"witness_violations", "certified_flips", "pooling_floor_violations", "triggers"} <= names
    assert all(r.reason.strip() for r in BUILTIN)
    assert all(REGISTRY.check_emittable(n).tier is Tier.EMPIRICAL for n in names if n.startswith("gate_"))


def test_register_is_idempotent_and_refuses_changes():
    reg = TierRegistry()
    assert "m" not in reg
    first = reg.register("m", "partial", "premise checked at runtime")
    assert reg.register("m", Tier.PARTIAL, "premise checked at runtime") == first
    with pytest.raises(ValueError, match="already registered"):
        reg.register("m", Tier.CERTIFIED, "premise checked at runtime")
    with pytest.raises(ValueError, match="reason"):
        reg.register("n", "certified", "")
    with pytest.raises(ValueError, match="tier"):
        reg.register("n", "proven", "why")
    assert reg.names() == ("m",)
