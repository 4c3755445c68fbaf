import json
import math

import pytest
from snapshot_factory import good_dict

from kvcert.contracts import Metric, Tier
from kvcert.probe import SCHEMA, Declared, ProbeSnapshot, ReadingRecord, SelfChecks, SnapshotError


def test_roundtrip_dict_json_and_file(tmp_path):
    d = good_dict()
    snap = ProbeSnapshot.from_dict(d)
    assert snap.schema == SCHEMA and snap.triggers == 123 and len(snap.readings) == 15
    assert snap.readings[0].metric == Metric.parse("attn_dist:tv@consume")
    assert snap.readings[0].tier is Tier.CERTIFIED
    assert json.loads(snap.to_json()) == d
    assert ProbeSnapshot.from_json(snap.to_json()) == snap
    path = snap.write(tmp_path / "s.json")
    assert ProbeSnapshot.load(path) == snap


def test_nan_survives_to_the_gate():
    d = good_dict()
    d["readings"][0]["value"] = float("nan")
    text = ProbeSnapshot.from_dict(d).to_json()
    assert "NaN" in text and math.isnan(ProbeSnapshot.from_json(text).readings[0].value)


def test_constructed_snapshot_matches_schema():
    snap = ProbeSnapshot(
        run_id="r",
        model="m",
        family="f",
        declared=Declared((0,), ("dense_kv",)),
        triggers=1,
        readings=[
            ReadingRecord(0, "dense_kv", "attn_dist:tv@consume", 1.4, "partial", "bound", "meter", unclipped=True)
        ],
        self_checks=SelfChecks(0, 0, 0),
    )
    out = json.loads(snap.to_json())
    assert out["readings"] == [
        {
            "layer": 0,
            "path": "dense_kv",
            "metric": "attn_dist:tv@consume",
            "value": 1.4,
            "tier": "partial",
            "kind": "bound",
            "name": "meter",
            "unclipped": True,
        }
    ]
    assert list(out) == [
        "schema",
        "run_id",
        "model",
        "family",
        "declared",
        "triggers",
        "readings",
        "self_checks",
    ]


def _mutate(path: list, value=None, delete: bool = False) -> dict:
    d = good_dict()
    target = d
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "delete", "match"),
    [
        (["triggers"], None, True, r"missing field\(s\) \['triggers'\]"),
        (["self_checks", "certified_flips"], None, True, r"self_checks: missing.*certified_flips"),
        (["readings", 2, "metric"], None, True, r"readings\[2\]: missing.*metric"),
        (["declared", "paths"], None, True, r"declared: missing.*paths"),
        (["schema"], "kvcert.probe/0", False, "schema"),
        (["triggers"], "12", False, "triggers"),
        (["triggers"], True, False, "triggers"),
        (["readings", 0, "metric"], "attn_dist:tv", False, r"readings\[0\].*object:norm@site"),
        (["readings", 0, "tier"], "measured", False, r"readings\[0\].*tier"),
        (["readings", 0, "kind"], "estimate", False, r"readings\[0\].*kind"),
        (["readings", 0, "path"], "dense", False, r"readings\[0\].*path"),
        (["readings", 0, "layer"], -1, False, r"readings\[0\].*layer"),
        (["readings", 0, "value"], "0.1", False, r"readings\[0\].*value"),
        (["readings", 0, "typo"], 1, False, r"readings\[0\]: unknown field"),
        (["declared", "layers"], [0, "1"], False, r"declared.layers\[1\]"),
        (["self_checks", "witness_violations"], 0.5, False, "witness_violations"),
        (["model"], "", False, "model"),
    ],
)
def test_malformed_snapshots_name_the_field(path, value, delete, match):
    with pytest.raises(SnapshotError, match=match):
        ProbeSnapshot.from_dict(_mutate(path, value, delete))


def test_empirical_bound_is_invalid():
    d = good_dict()
    d["readings"][0]["tier"] = "empirical"  # kind stays "bound"
    with pytest.raises(SnapshotError, match="'bound' cannot have tier 'empirical'"):
        ProbeSnapshot.from_dict(d)
    with pytest.raises(SnapshotError, match="empirical"):
        ReadingRecord(0, "dense_kv", "attn_dist:tv@consume", 0.1, "empirical", "bound", "meter")


def test_malformed_json_and_unreadable_files(tmp_path):
    with pytest.raises(SnapshotError, match="malformed JSON"):
        ProbeSnapshot.from_json('{"schema": "kvcert.probe/1", ')
    with pytest.raises(SnapshotError, match="JSON object"):
        ProbeSnapshot.from_json("[1, 2]")
    with pytest.raises(SnapshotError, match="cannot read"):
        ProbeSnapshot.load(tmp_path / "absent.json")
