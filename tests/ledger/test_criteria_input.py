"""Issue 21, evidence: malformed gate input (JSON snapshots) is one clear line and exit 2, never a traceback;
negative counters cannot cancel each other; duplicated keys cannot hide a failing value."""

import json

import pytest
from evidence_logs import run_requests
from typer.testing import CliRunner

from kvcert.cli.ledger_command import app
from kvcert.ledger import Ledger, evaluate
from kvcert.ledger.criteria import GateInputError, check_snapshot

runner = CliRunner()


def _snapshot() -> dict:
    led = Ledger()
    run_requests(led)
    return json.loads(json.dumps(led.snapshot()))


def _gate_text(tmp_path, text: str):
    (tmp_path / "s.json").write_text(text)
    return runner.invoke(app, ["gate", str(tmp_path / "s.json")])


def _assert_unusable(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [x for x in result.output.splitlines() if x.startswith("kvcert ledger gate: error: ")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), result.output


def test_negative_counters_cannot_cancel(tmp_path):
    snap = _snapshot()
    snap["accounts"]["0"]["n_read_foreign_owner"] = 1
    snap["accounts"]["1"]["n_read_foreign_owner"] = -1  # the sum is 0: passed on main
    _assert_unusable(_gate_text(tmp_path, json.dumps(snap)), "accounts.1.n_read_foreign_owner", "int >= 0", "-1")
    with pytest.raises(GateInputError, match="n_read_foreign_owner"):
        evaluate(snap)


def test_a_duplicated_key_cannot_hide_a_failing_value(tmp_path):
    text = json.dumps(_snapshot()).replace(
        '"identity_fail_closed": 0', '"identity_fail_closed": 5, "identity_fail_closed": 0'
    )
    _assert_unusable(_gate_text(tmp_path, text), "duplicated key 'identity_fail_closed'")


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda s: s.update(accounts=[1, 2]), "accounts: expected an object"),
        (lambda s: s["accounts"].update({"x": {}}), "account keys are request UIDs"),
        (lambda s: s["accounts"]["0"].update(n_reads="8"), "accounts.0.n_reads: expected an int >= 0"),
        (lambda s: s["accounts"]["0"].update(n_reads=True), "accounts.0.n_reads"),
        (lambda s: s["accounts"]["0"].update(delta_spent=float("nan")), "delta_spent"),
        (lambda s: s["accounts"]["0"].update(delta_req=5), "delta_req: expected a number in (0, 1]"),
        (lambda s: s["accounts"]["0"].update(uid=7), "accounts.0.uid"),
        (lambda s: s["accounts"].update({"0": [0]}), "accounts.0: expected an object"),
        (lambda s: s["global"].update(uid_group_fallbacks=-3), "global.uid_group_fallbacks"),
        (lambda s: s.update({"global": "none"}), "global: expected an object"),
        (lambda s: s["eprocess"].update(crossed="no"), "eprocess.crossed: expected true or false"),
        (lambda s: s["eprocess"].update(n_factors=-1), "eprocess.n_factors"),
        (lambda s: s["accounts"]["0"].update(eprocess=3), "accounts.0.eprocess: expected an object"),
        (lambda s: s.update(rank=2), "rank 2 outside [0, n_ranks=1)"),
        (lambda s: s.update(n_ranks=0), "n_ranks: expected an int >= 1"),
    ],
)
def test_wrong_types_and_ranges_are_one_line(tmp_path, mutate, needle):
    snap = _snapshot()
    mutate(snap)
    _assert_unusable(_gate_text(tmp_path, json.dumps(snap)), needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[" * 100_000 + "]" * 100_000, "nesting depth 100000 exceeds the limit of 64"),
        ('{"accounts": ', "malformed JSON"),
        ("\xff\xfe", "neither a ledger snapshot"),
        ("3", "expected a ledger snapshot object"),
    ],
)
def test_malformed_files_are_one_line(tmp_path, text, needle):
    _assert_unusable(_gate_text(tmp_path, text), needle)


def test_missing_fields_still_fail_as_missing_data(tmp_path):
    snap = _snapshot()
    del snap["accounts"]["0"]["delta_spent"]
    del snap["accounts"]["1"]["n_read_stale"]
    r = _gate_text(tmp_path, json.dumps(snap))
    assert r.exit_code == 1 and "FAIL  read_stale==0" in r.output and "missing data" in r.output
    assert "FAIL  all_budgets<=delta_req" in r.output
    assert check_snapshot(_snapshot())["model"] == "model"


def test_a_bare_snapshot_says_it_is_not_evidence(tmp_path):
    r = _gate_text(tmp_path, json.dumps(_snapshot()))
    assert r.exit_code == 0 and "NOTE  a bare JSON snapshot is not tamper-evident" in r.output
