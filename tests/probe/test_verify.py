import re

import pytest
from snapshot_factory import broken, good_dict, write

from kvcert.contracts import REGISTRY, Tier, TierRegistry
from kvcert.probe import ProbeSnapshot, verify, verify_file
from kvcert.probe.verify import registered_name


def _verify(d: dict):
    return verify(ProbeSnapshot.from_dict(d))


def test_good_snapshot_passes():
    r = _verify(good_dict())
    assert r.ok and r.stage == "pass" and r.reasons == ()


@pytest.mark.parametrize(
    ("mode", "stage", "cause"),
    [
        ("missing_layer", "coverage", r"declared layer\(s\) without readings: \[1\]"),
        ("missing_path", "coverage", r"declared path\(s\) without readings: \['recurrent'\]"),
        ("zero_triggers", "coverage", "zero-trigger run"),
        ("nan", "magnitude", "non-finite value nan"),
        ("inf", "magnitude", "non-finite value inf"),
        ("tv_above_one", "magnitude", r"value 1.2 outside the physical range \[0.0, 1.0\]"),
        ("negative_norm", "magnitude", r"value -0.01 outside the physical range \[0.0, inf\]"),
        ("witness_violation", "soundness", "witness_violations = 1"),
        ("certified_flip", "soundness", "certified_flips = 2"),
        ("pooling_floor", "soundness", "pooling_floor_violations = 1"),
        ("unregistered_metric", "registry", "'made_up_meter' is not in the tier registry"),
        ("wrong_tier", "registry", "'latent_witness' recorded as partial, registered as certified"),
    ],
)
def test_each_failure_mode_voids_the_run(mode, stage, cause):
    r = _verify(broken(mode))
    assert not r.ok and r.stage == stage
    assert len(r.reasons) == 1 and r.reasons[0].startswith(f"{stage}: ")
    assert any(re.search(cause, reason) for reason in r.reasons), r.reasons


def test_all_stages_run_and_first_failure_is_named():
    d = broken("witness_violation")
    d["triggers"] = 0
    d["readings"][0]["value"] = -1.0
    r = _verify(d)
    assert r.stage == "coverage" and [x.split(":")[0] for x in r.reasons] == [
        "coverage",
        "magnitude",
        "soundness",
    ]


def test_undeclared_layers_and_paths_fail_coverage():
    d = good_dict()
    d["declared"] = {"layers": [0, 1], "paths": ["dense_kv"]}
    r = _verify(d)
    assert r.stage == "coverage"
    assert any("undeclared layer(s): [2]" in x for x in r.reasons)
    assert any("undeclared path(s)" in x and "pooling" in x for x in r.reasons)
    d["declared"] = {"layers": [], "paths": []}
    d["readings"] = []
    assert {"coverage: no layers declared", "coverage: no paths declared"} <= set(_verify(d).reasons)


def test_unclipped_tv_bound_may_exceed_one_but_not_readings():
    d = good_dict()
    d["readings"][0].update(value=1.473, unclipped=True)  # dense_kv, attn_dist:tv bound
    assert _verify(d).ok
    d["readings"][0]["value"] = -0.1
    assert _verify(d).stage == "magnitude"
    d = good_dict()
    d["readings"][0].update(value=1.473, unclipped=True, kind="reading")
    assert _verify(d).stage == "magnitude"


def test_bounded_metrics_and_unbounded_logs():
    d = good_dict()
    pooling = next(r for r in d["readings"] if r["path"] == "pooling")
    pooling["value"] = 1.0 + 1e-9  # a fraction above 1
    assert _verify(d).stage == "magnitude"
    d = good_dict()
    recurrent = next(r for r in d["readings"] if r["path"] == "recurrent")
    recurrent["value"] = -1e6  # Σ log a_t may be any finite real
    assert _verify(d).ok


def test_verify_file_reports_schema_failures(tmp_path):
    assert verify_file(write(tmp_path / "good.json", good_dict())).ok
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = verify_file(bad)
    assert not r.ok and r.stage == "schema" and "malformed JSON" in r.reasons[0]
    d = good_dict()
    del d["self_checks"]
    r = verify_file(write(tmp_path / "missing.json", d))
    assert r.stage == "schema" and "self_checks" in r.reasons[0]
    with pytest.raises(ValueError, match="snapshot"):
        verify(good_dict())  # type: ignore[arg-type]


def test_registry_checks_every_reading_with_suffixes_stripped():
    d = good_dict()
    names = {r["name"] for r in d["readings"]}
    assert any("/" in n for n in names) and all(registered_name(n) in REGISTRY for n in names)
    d["readings"][4]["name"] = "pool_top1_norm_v2/max"  # a near miss of a registered name
    d["readings"][7]["tier"] = "empirical"  # sel_bS (partial) relabelled: a reading, so schema accepts it
    d["readings"][7]["kind"] = "reading"
    r = _verify(d)
    assert r.stage == "registry" and len(r.reasons) == 2
    assert "'pool_top1_norm_v2' is not in the tier registry" in r.reasons[0]
    assert "'sel_bS' recorded as empirical, registered as partial" in r.reasons[1]


def test_reference_quantities_cannot_be_bounds():
    reg = TierRegistry(REGISTRY.check_emittable(n) for n in REGISTRY.names())
    reg.register("shadow_tv", Tier.CERTIFIED, "TV against the exact cache (needs the reference)", True)
    d = good_dict()
    d["readings"][0]["name"] = "shadow_tv"  # dense_kv, a certified bound
    r = verify(ProbeSnapshot.from_dict(d), registry=reg)
    assert r.stage == "registry" and r.reasons == (
        "registry: readings[0] 'shadow_tv' (layer 0, dense_kv): metric 'shadow_tv' needs the uncompressed "
        "reference and cannot be a bound",
    )
    d["readings"][0]["kind"] = "reading"  # as a validate-mode reading it is allowed
    assert verify(ProbeSnapshot.from_dict(d), registry=reg).ok
    with pytest.raises(ValueError, match="registry"):
        verify(ProbeSnapshot.from_dict(d), registry={})  # type: ignore[arg-type]
