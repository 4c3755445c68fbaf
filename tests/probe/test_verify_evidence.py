"""Issue 21, evidence: a probe snapshot file is tamper-evident (digest) and verify refuses the forged
snapshots the reliability probe passed on main: a certified bound below its own measured truth, a
certificate relabelled as another metric, a layer removed from both the declaration and the readings, a
duplicated key hiding a failing self-check, and nesting deep enough to crash the parser."""

import copy
import json

import pytest
from snapshot_factory import good_dict, with_digest, write

from kvcert.probe import ProbeSnapshot, verify, verify_file
from kvcert.probe.verify import METRIC_CONTRACTS, MODEL_LAYERS


def _with_truth(value: float, cert: float) -> dict:
    """good_dict plus a validate-mode true TV on dense_kv layer 0, whose certificate is ``cert``."""
    d = good_dict()
    d["readings"][0]["value"] = cert  # dense_kv layer 0, certificates, certified bound
    d["readings"].append(
        {
            "layer": 0,
            "path": "dense_kv",
            "metric": "attn_dist:tv@offline",
            "value": value,
            "tier": "empirical",
            "kind": "reading",
            "name": "true_tv",
        }
    )
    return d


def test_written_files_carry_a_digest_that_verifies(tmp_path):
    snap = ProbeSnapshot.from_dict(good_dict())
    path = snap.write(tmp_path / "s.json")
    data = json.loads(path.read_text())
    assert data["digest"] == snap.digest() and data["digest"].startswith("sha256:")
    assert verify_file(path).ok
    # layout is not content: the digest is over the canonical form
    path.write_text(json.dumps(data, indent=4, sort_keys=True))
    assert verify_file(path).ok


def test_an_edited_file_fails_integrity(tmp_path):
    path = ProbeSnapshot.from_dict(good_dict()).write(tmp_path / "s.json")
    data = json.loads(path.read_text())
    data["self_checks"]["witness_violations"] = 0
    data["readings"][0]["value"] = 0.001  # a smaller certificate
    path.write_text(json.dumps(data))
    r = verify_file(path)
    assert not r.ok and r.stage == "integrity" and "does not match the content" in r.reasons[0]


def test_a_file_without_digest_is_not_verifiable(tmp_path):
    r = verify_file(write(tmp_path / "s.json", good_dict(), digest=False))
    assert not r.ok and r.stage == "integrity"
    assert r.reasons == ("integrity: no digest: the snapshot's integrity cannot be verified (re-run the probe)",)
    bad = good_dict()
    bad["digest"] = "md5:abc"
    assert verify_file(write(tmp_path / "t.json", bad, digest=False)).stage == "schema"


def test_a_bound_below_its_own_measured_truth_fails():
    assert verify(ProbeSnapshot.from_dict(_with_truth(0.02, 0.031))).ok  # the truth below the bound: sound
    r = verify(ProbeSnapshot.from_dict(_with_truth(0.9, 0.001)))  # the probe
    assert not r.ok and r.stage == "soundness"
    assert "certified bound 0.001 is below the measured attn_dist:tv 0.9 of the same layer" in r.reasons[0]
    # the truth of one layer says nothing about another layer's bound
    d = _with_truth(0.9, 0.95)
    d["readings"][5]["value"] = 0.001  # dense_kv layer 1
    assert verify(ProbeSnapshot.from_dict(d)).ok


def test_a_certificate_relabelled_as_another_metric_fails():
    d = good_dict()
    d["readings"][0]["metric"] = "kv_entry:l2@write"  # certificates is a TV bound
    r = verify(ProbeSnapshot.from_dict(d))
    assert not r.ok and r.stage == "registry"
    assert "'certificates' recorded as metric kv_entry:l2@write, emitted as attn_dist:tv@consume" in r.reasons[0]
    assert {"certificates", "true_tv", "chain_tv", "band_witness"} <= METRIC_CONTRACTS.keys()


def test_a_layer_removed_from_declaration_and_readings_fails():
    d = good_dict()
    d["declared"]["layers"] = [0, 2]
    d["readings"] = [r for r in d["readings"] if r["layer"] != 1]
    r = verify(ProbeSnapshot.from_dict(d))
    assert not r.ok and r.stage == "coverage" and "missing [1]" in r.reasons[0]
    d = good_dict()  # the last layer of a model of known depth
    d["model"] = "smollm2-135m"
    d["declared"]["layers"] = list(range(MODEL_LAYERS["smollm2-135m"] - 1))
    d["readings"] = [dict(r, layer=layer) for layer in d["declared"]["layers"] for r in good_dict()["readings"][:5]]
    r = verify(ProbeSnapshot.from_dict(d))
    assert not r.ok and r.stage == "coverage" and "0 … 29 of 'smollm2-135m'; missing [29]" in r.reasons[0]
    d["declared"]["layers"] = [0, 0, 1]
    assert verify(ProbeSnapshot.from_dict(d)).stage == "coverage"


def test_a_duplicated_key_cannot_hide_a_failing_self_check(tmp_path):
    text = json.dumps(with_digest(good_dict())).replace(
        '"witness_violations": 0', '"witness_violations": 5, "witness_violations": 0'
    )
    (tmp_path / "s.json").write_text(text)
    r = verify_file(tmp_path / "s.json")
    assert not r.ok and r.stage == "schema" and "duplicated key 'witness_violations'" in r.reasons[0]


def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path):
    (tmp_path / "deep.json").write_text('{"schema": ' + "[" * 100_000 + "]" * 100_000 + "}")
    r = verify_file(tmp_path / "deep.json")
    assert not r.ok and r.stage == "schema" and r.reasons == ("schema: nesting depth 100001 exceeds the limit of 64",)
    (tmp_path / "ok.json").write_text(json.dumps({"x": "[[[[" * 100}))  # brackets inside strings do not count
    assert "nesting" not in verify_file(tmp_path / "ok.json").reasons[0]


def test_verify_cli_fails_tampered_files(tmp_path):
    from typer.testing import CliRunner

    from kvcert.cli.probe import app

    good = ProbeSnapshot.from_dict(good_dict()).write(tmp_path / "good.json")
    data = json.loads(good.read_text())
    forged = copy.deepcopy(data)
    forged["readings"][0]["value"] = 0.0001
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    r = CliRunner().invoke(app, ["verify", str(good), str(tmp_path / "forged.json")])
    assert r.exit_code == 1 and f"PASS {good}" in r.output and "[integrity]" in r.output


@pytest.mark.parametrize("field", ["declared", "readings", "self_checks"])
def test_digest_covers_every_part(field):
    a = ProbeSnapshot.from_dict(good_dict())
    d = good_dict()
    if field == "declared":
        d["declared"]["paths"] = d["declared"]["paths"][::-1]
    elif field == "readings":
        d["readings"][5]["value"] += 1e-12
    else:
        d["self_checks"]["certified_flips"] = 1
    assert ProbeSnapshot.from_dict(d).digest() != a.digest()
