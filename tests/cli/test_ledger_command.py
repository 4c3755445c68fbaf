import json
import subprocess
import sys

import numpy as np
from typer.testing import CliRunner

from kvcert.cli.ledger_command import app
from kvcert.ledger import DitheredAdmission, EventLog, Ledger, observed

runner = CliRunner()


def _run(ledger: Ledger, fail_closed: bool) -> None:
    rng = np.random.default_rng(3)
    for i in range(3):
        uid = ledger.open_request()
        x = rng.normal(size=(8, 4))
        adm = DitheredAdmission(x, np.full((8, 4), 0.02), threshold=0.5, rng=rng)
        ledger.write("k", 0, np.arange(8) + 8 * i, np.full(8, uid), adm, rule="probabilistic")
        ledger.read("k", 0, np.array([uid]), np.array([8 * i]), np.array([8]))
    if fail_closed:
        ledger.write("k", 1, np.arange(2), np.full(2, -1), observed(np.ones(2, bool)))


def test_gate_good_run(tmp_path):
    led = Ledger()
    _run(led, fail_closed=False)
    led.save(tmp_path / "ledger.json")
    r = runner.invoke(app, ["gate", str(tmp_path), "--requests", "3"])
    assert r.exit_code == 0, r.output
    assert "gate: PASS" in r.output
    r = runner.invoke(app, ["gate", str(tmp_path / "ledger.json"), "--requests", "8"])
    assert r.exit_code == 1 and "FAIL  n_user_requests" in r.output


def test_gate_bad_run_and_log_input(tmp_path):
    log = EventLog(tmp_path / "ledger.db")
    led = Ledger(log=log)
    _run(led, fail_closed=True)
    log.close()
    r = runner.invoke(app, ["gate", str(tmp_path / "ledger.db")])
    assert r.exit_code == 1
    assert "FAIL  identity_fail_closed==0" in r.output and "gate: FAIL" in r.output


def test_gate_missing_data(tmp_path):
    led = Ledger()
    _run(led, fail_closed=False)
    snap = led.snapshot()
    del snap["eprocess"]
    (tmp_path / "s.json").write_text(json.dumps(snap))
    r = runner.invoke(app, ["gate", str(tmp_path / "s.json")])
    assert r.exit_code == 1 and "missing data" in r.output
    r = runner.invoke(app, ["gate", str(tmp_path / "nope.json")])
    assert r.exit_code == 2
    assert r.output.startswith("kvcert ledger gate: error: ") and r.output.count("\n") == 1  # the CLI's one line
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert runner.invoke(app, ["gate", str(tmp_path / "junk.json")]).exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.invoke(app, ["gate", str(empty)]).exit_code == 2


def test_replay_check_against(tmp_path):
    log = EventLog(tmp_path / "ledger.db")
    led = Ledger(log=log)
    _run(led, fail_closed=True)
    log.close()
    led.save(tmp_path / "state.json")
    r = runner.invoke(app, ["replay", str(tmp_path / "ledger.db"), "--check-against", str(tmp_path / "state.json")])
    assert r.exit_code == 0, r.output
    assert "accounts=3" in r.output and "replay == live: yes" in r.output
    assert "tiers: coverage empirical" in r.output  # every printed number carries its tier
    snap = tmp_path / "snap.json"
    assert runner.invoke(app, ["replay", str(tmp_path / "ledger.db"), "--out", str(snap)]).exit_code == 0
    again = runner.invoke(app, ["replay", str(tmp_path / "ledger.db"), "--out", str(snap)])
    assert again.exit_code == 2 and "exists; pass --overwrite" in again.output  # never replaced silently
    assert runner.invoke(app, ["replay", str(tmp_path / "ledger.db"), "--out", str(snap), "--overwrite"]).exit_code == 0
    assert runner.invoke(app, ["replay", str(tmp_path / "ledger.db"), "--out", str(tmp_path)]).exit_code == 2
    state = json.loads((tmp_path / "state.json").read_text())
    state["accounts"]["1"]["n_reads"] += 1
    (tmp_path / "bad.json").write_text(json.dumps(state))
    r = runner.invoke(app, ["replay", str(tmp_path / "ledger.db"), "--check-against", str(tmp_path / "bad.json")])
    assert r.exit_code == 1 and "$.accounts.1.n_reads" in r.output
    r = runner.invoke(app, ["replay", str(tmp_path / "missing.db")])
    assert r.exit_code == 2 and r.output.startswith("kvcert ledger replay: error: ") and "missing.db" in r.output


def test_sentinel_command():
    r = runner.invoke(app, ["sentinel", "--slots", "1024", "--r", "128", "--bad", "4"])
    assert r.exit_code == 0 and "prob >= 0.99: 10" in r.output
    r = runner.invoke(app, ["sentinel", "--slots", "10", "--r", "1", "--bad", "11"])
    assert r.exit_code == 2 and r.output.startswith("kvcert ledger sentinel: error: ")


def test_gate_replica_run_directory(tmp_path):
    # rank*/ subdirectories are one replica run: every declared rank must be present and coupled
    for rank in range(2):
        led = Ledger(rank=rank, n_ranks=2)
        _run(led, fail_closed=False)
        (tmp_path / f"rank{rank}").mkdir()
        led.save(tmp_path / f"rank{rank}" / "ledger.json")
    r = runner.invoke(app, ["gate", str(tmp_path), "--requests", "3"])
    # both ranks draw their dither from the same seed (_run), so they are coupled
    assert r.exit_code == 0, r.output
    assert "PASS  n_ranks_seen==n_ranks" in r.output and "2 of 2 ranks" in r.output
    r = runner.invoke(app, ["gate", str(tmp_path / "rank0" / "ledger.json")])  # rank 0 alone
    assert r.exit_code == 1 and "FAIL  n_ranks_seen==n_ranks" in r.output and "missing [1]" in r.output
    snap = json.loads((tmp_path / "rank1" / "ledger.json").read_text())
    snap["accounts"]["2"]["n_authorized"] -= 1
    (tmp_path / "rank1" / "ledger.json").write_text(json.dumps(snap))
    r = runner.invoke(app, ["gate", str(tmp_path)])
    assert r.exit_code == 1 and "rank 1: account 2 n_authorized" in r.output
    del snap["rank"]
    (tmp_path / "rank1" / "ledger.json").write_text(json.dumps(snap))
    r = runner.invoke(app, ["gate", str(tmp_path)])
    assert r.exit_code == 1 and "missing data (a snapshot lacks rank or n_ranks)" in r.output
    (tmp_path / "rank1" / "ledger.json").unlink()
    assert runner.invoke(app, ["gate", str(tmp_path)]).exit_code == 2  # a rank directory without a ledger


def test_the_ledger_commands_do_not_load_the_model_stack():
    """The ledger's commands are imported beside a running vLLM engine (the server tests), whose kernel dispatcher
    trips over numba's loaded library: importing them must not load numba, transformers or the RULER generators."""
    code = (
        "import sys, kvcert.cli.ledger_command; "
        "print(sorted(m for m in ('numba', 'llvmlite.binding.ffi', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
