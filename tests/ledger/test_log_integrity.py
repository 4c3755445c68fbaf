"""Issue 21, evidence: a hand-edited ledger log never passes. Every edit of a closed log is refused by the hash
chain, naming the first bad sequence number; events the live API would refuse are refused by replay even when
the chain was recomputed; a legacy (unchained) or unclosed log never passes the gate."""

import json
import re
import time

import numpy as np
import pytest
from evidence_logs import closed_log, edit, forged_log, legacy_copy, meta_of, rows, run_requests
from typer.testing import CliRunner

from kvcert.cli.ledger_command import app
from kvcert.ledger import EventLog, Ledger, replay
from kvcert.ledger.events import BudgetCharge, FaultReport, LogError, OpenRequest, SlotRead, SlotWrite
from kvcert.ledger.log import LogIntegrityError, LogReader
from kvcert.ledger.replay import replay_verified
from kvcert.ledger.slots import MAX_SLOTS

runner = CliRunner()
NAN = float("nan")


def _gate(*args: str):
    return runner.invoke(app, ["gate", *map(str, args)])


def _one_line_failure(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    line = next(x for x in result.output.splitlines() if re.match(r"kvcert ledger (gate|replay): error: ", x))
    for needle in needles:
        assert needle in line, line


def test_a_genuine_closed_log_verifies_and_passes(tmp_path):
    log = closed_log(tmp_path / "ledger.db")
    ledger, reader = replay_verified(log)
    assert reader.chained and reader.closed and reader.seq == len(rows(log)) == 9
    assert reader.describe().startswith("chain verified and closed: 9 events")
    r = _gate(log, "--requests", "3")
    assert r.exit_code == 0 and "PASS  log_integrity" in r.output and "gate: PASS" in r.output
    head = f"{reader.seq}:{reader.prev.hex()}"
    assert _gate(log, "--expect-head", head).exit_code == 0


def test_deleting_the_failing_events_no_longer_passes(tmp_path):
    # the probe: delete the fail-closed write and the foreign read of a failing log
    failing = closed_log(tmp_path / "failing.db", fail=True)
    assert _gate(failing).exit_code == 1
    n = len(rows(failing))
    cut = edit(failing, tmp_path / "cut.db", ("DELETE FROM events WHERE seq >= ?", (n - 1,)))
    _one_line_failure(_gate(cut), 2, f"event seq {n - 1}", "head recorded at close")
    # ... and also the recorded head: the log now looks unclosed, which never passes either
    headless = edit(cut, tmp_path / "headless.db", ("DELETE FROM meta WHERE key = 'head'", ()))
    r = _gate(headless)
    assert r.exit_code == 1 and "FAIL  log_integrity" in r.output and "not closed" in r.output
    # against the head kept outside the log, the cut is named
    _, reader = replay_verified(failing)
    r = _gate(headless, "--expect-head", f"{reader.seq}:{reader.prev.hex()}")
    assert r.exit_code == 1 and "FAIL  log_head==expected" in r.output


@pytest.mark.parametrize(
    ("name", "statements", "seq", "what"),
    [
        ("delete", [("DELETE FROM events WHERE seq = 3", ())], 3, "sequence broken: found seq 4"),
        (
            "insert",
            [
                ("UPDATE events SET seq = seq + 100 WHERE seq >= 4", ()),
                ("UPDATE events SET seq = seq - 99 WHERE seq >= 104", ()),
                ("INSERT INTO events SELECT 4, kind, meta, a, b, c, d, h FROM events WHERE seq = 1", ()),
            ],
            4,
            "hash chain broken",
        ),
        (
            "reorder",
            [
                ("UPDATE events SET seq = -1 WHERE seq = 2", ()),
                ("UPDATE events SET seq = 2 WHERE seq = 3", ()),
                ("UPDATE events SET seq = 3 WHERE seq = -1", ()),
            ],
            2,
            "hash chain broken",
        ),
        (
            "duplicate_open",
            [("INSERT INTO events SELECT 10, kind, meta, a, b, c, d, h FROM events WHERE seq = 1", ())],
            10,
            "hash chain broken",
        ),
        ("rewrite_states", [("UPDATE events SET c = zeroblob(8) WHERE seq = 2", ())], 2, "hash chain broken"),
        ("rewrite_budget", [("UPDATE meta SET value = '0.9' WHERE key = 'delta_req'", ())], 1, "configuration"),
        ("drop_hashes", [("ALTER TABLE events DROP COLUMN h", ())], 1, "column has been removed"),
        ("drop_chain_id", [("DELETE FROM meta WHERE key = 'chain'", ())], 1, "chain metadata missing"),
        (
            "rewrite_head",
            [('UPDATE meta SET value = \'{"seq": 9, "hash": "00"}\' WHERE key = \'head\'', ())],
            10,
            "head recorded at close",
        ),
    ],
)
def test_every_edit_of_a_closed_log_is_refused_naming_the_first_bad_seq(tmp_path, name, statements, seq, what):
    log = closed_log(tmp_path / "ledger.db")
    bad = edit(log, tmp_path / f"{name}.db", *statements)
    with pytest.raises(LogIntegrityError, match=f"event seq {seq}: .*{what}"):
        replay(bad)
    _one_line_failure(_gate(bad), 2, f"event seq {seq}")
    _one_line_failure(runner.invoke(app, ["replay", str(bad)]), 2, f"event seq {seq}")


def _cfg() -> dict:
    return {"delta_req": 0.01, "delta_e": 0.01, "model": "m", "max_incidents": 8, "rank": 0, "n_ranks": 1}


def _w(slots, owners, states, rule="deterministic", factors=None) -> SlotWrite:
    s = np.asarray(slots, dtype=np.int64)
    f = np.full(s.size, NAN) if factors is None else np.asarray(factors, dtype=np.float64)
    return SlotWrite("k", 0, s, np.asarray(owners, dtype=np.int64), np.asarray(states, dtype=np.uint8), rule, f)


def _r(starts, counts, steps=None, readers=None) -> SlotRead:
    st = np.asarray(starts, dtype=np.int64)
    rd = np.zeros(st.size, dtype=np.int64) if readers is None else np.asarray(readers, dtype=np.int64)
    sp = np.ones(st.size, dtype=np.int64) if steps is None else np.asarray(steps, dtype=np.int64)
    return SlotRead("k", 0, rd, st, sp, np.asarray(counts, dtype=np.int64), np.full(st.size, -1, dtype=np.int64))


OPEN = OpenRequest(0, 0.01)
INVALID = {  # events the live API refuses, each with a recomputed (intact) chain
    "restored_in_deterministic": ([OPEN, _w([0, 1], [0, 0], [1, 3])], 2, "restored_exact inside a deterministic"),
    "slot_negative": ([OPEN, _w([-5], [0], [1])], 2, "slots must be >= 0, got -5"),
    "slot_huge": ([OPEN, _w([10**12], [0], [1])], 2, f"slots must be < MAX_SLOTS = {MAX_SLOTS}"),
    "duplicate_open": ([OPEN, _w([0], [0], [1]), OPEN], 3, "request UID 0 opened again"),
    "uid_out_of_order": ([OpenRequest(5, 0.01), OpenRequest(2, 0.01)], 2, "request UID 2 out of order"),
    "owner_not_open": ([OPEN, _w([0], [7], [1])], 2, "request UID 7 has no open account"),
    "unattributed_compressed": ([OPEN, _w([0], [-1], [1])], 2, "must be kept exact"),
    "empirical_compressed": ([OPEN, _w([0], [0], [1], rule="empirical")], 2, "empirical write keeps every entry"),
    "partly_unwritten": ([OPEN, _w([0, 1], [0, 0], [0, 1])], 2, "state unwritten"),
    "unknown_state": ([OPEN, _w([0], [0], [9], rule="probabilistic", factors=[0.0])], 2, "unknown slot state 9"),
    "factor_on_kept": ([OPEN, _w([0], [0], [2], rule="probabilistic", factors=[0.5])], 2, "NaN on kept_exact"),
    "infinite_factor": ([OPEN, _w([0], [0], [1], rule="probabilistic", factors=[float("inf")])], 2, "finite"),
    "duplicate_slots": ([OPEN, _w([3, 3], [0, 0], [1, 1])], 2, "distinct"),
    "read_negative_count": ([OPEN, _r([0], [-1])], 2, "must be >= 0"),
    "read_huge_slot": ([OPEN, _r([10**12], [1])], 2, "read slot must be < MAX_SLOTS"),
    "read_huge_stride": ([OPEN, _r([0], [3], steps=[MAX_SLOTS - 1])], 2, "read slot must be < MAX_SLOTS"),
    "read_too_many": ([OPEN, _r([0, 0], [MAX_SLOTS, MAX_SLOTS], steps=[0, 0])], 2, "covers"),
    "reader_not_open": ([OPEN, _r([0], [1], readers=[4])], 2, "request UID 4 has no open account"),
    "fault_negative_slot": ([OPEN, FaultReport("x", "k", 0, -2)], 2, "fault slot must be >= 0"),
    "bad_budget": ([OpenRequest(0, 2.0)], 1, "delta_req"),
    "charge_not_open": ([OPEN, BudgetCharge(3, 1, 1e-6)], 2, "request UID 3, which has no open account"),
    "charge_negative": ([OPEN, BudgetCharge(0, -1, 1e-6)], 2, "cells must be a non-negative int"),
    "charge_bad_delta": ([OPEN, BudgetCharge(0, 1, 0.0)], 2, "delta_loc must lie in"),
    "empty_pool": ([OPEN, FaultReport("x", "", 0, 1)], 2, "pool must be a non-empty string"),
    # rows of the wrong shape (what a truncated or hand-built row looks like)
    "header_not_json": ([("open", "{", None, None, None, None)], 1, "header is not valid JSON"),
    "header_too_short": ([("open", "[0]", None, None, None, None)], 1, "expected a list of 2 fields"),
    "header_wrong_type": ([("open", '["0", 0.01]', None, None, None, None)], 1, "expected int"),
    "bool_as_int": ([("open", "[true, 0.01]", None, None, None, None)], 1, "expected int"),
    "unknown_kind": ([("bogus", "[]", None, None, None, None)], 1, "unknown event kind"),
    "truncated_blob": (
        [OPEN, ("write", '["k", 0, "deterministic", false]', b"\0" * 7, b"", b"", b"")],
        2,
        "not a whole number",
    ),
    "missing_blob": (
        [OPEN, ("write", '["k", 0, "deterministic", false]', None, None, None, None)],
        2,
        "expected a byte array",
    ),
    "length_mismatch": (
        [OPEN, ("write", '["k", 0, "deterministic", false]', b"\0" * 16, b"\0" * 8, b"\1", b"\0" * 8)],
        2,
        "differ in length",
    ),
    "read_ranges_mismatch": (
        [OPEN, ("read", '["k", 0, false, false]', b"\0" * 24, b"\0" * 8, None, None)],
        2,
        "differ in length",
    ),
    "bad_rule": ([OPEN, ("write", '["k", 0, "lucky", false]', b"", b"", b"", b"")], 2, "rule must be one of"),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_events_the_live_api_refuses_are_refused_by_replay(tmp_path, name):
    events, seq, what = INVALID[name]
    log = forged_log(tmp_path / "forged.db", events, _cfg())
    start = time.perf_counter()
    with pytest.raises(LogError, match=f"event seq {seq}: .*{what}"):
        replay(log)
    assert time.perf_counter() - start < 5  # refused before any allocation (no 931 GiB table)
    _one_line_failure(_gate(log), 2, f"event seq {seq}")


def test_the_live_api_refuses_the_same_slots(tmp_path):
    led = Ledger()
    uid = led.open_request()
    for slot in (-5, 10**12, MAX_SLOTS):
        with pytest.raises(ValueError, match="slots must be"):
            led.write("k", 0, np.array([slot]), np.array([uid]), lambda s, o: None)
    with pytest.raises(ValueError, match="read slot must be < MAX_SLOTS"):
        led.read("k", 0, np.array([uid]), np.array([10**12]), np.array([1]))
    with pytest.raises(ValueError, match="fault slot"):
        led.report_fault("x", "k", 0, -5)
    assert led.tables[("k", 0)].state.shape[0] == 64  # nothing was grown


def test_malformed_metadata_is_one_line(tmp_path):
    log = closed_log(tmp_path / "ledger.db")
    bad = edit(log, tmp_path / "bad.db", ("UPDATE meta SET value = '\"x\"' WHERE key = 'rank'", ()))
    _one_line_failure(_gate(bad), 2, "metadata rank must be int")
    gone = edit(log, tmp_path / "gone.db", ("DROP TABLE events", ()))
    _one_line_failure(_gate(gone), 2, "not a kvcert ledger log")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    _one_line_failure(_gate(junk), 2, "junk.db")


def test_an_unchained_legacy_log_is_reported_and_never_passes(tmp_path):
    legacy = legacy_copy(closed_log(tmp_path / "ledger.db"), tmp_path / "legacy.db")
    ledger, reader = replay_verified(legacy)
    assert not reader.chained and len(ledger.accounts) == 3
    assert reader.describe() == "unchained legacy log: integrity not verifiable (9 events)"
    r = _gate(legacy, "--requests", "3")
    assert r.exit_code == 1 and "FAIL  log_integrity" in r.output and "unchained legacy log" in r.output
    r = runner.invoke(app, ["replay", str(legacy)])
    assert r.exit_code == 1 and "integrity: FAIL unchained legacy log: integrity not verifiable" in r.output
    with pytest.raises(LogError, match="unchained legacy log: it cannot be resumed"):
        EventLog(legacy, resume=True)


def test_an_unclosed_log_never_passes_but_replays(tmp_path):
    path = tmp_path / "open.db"
    log = EventLog(path)
    run_requests(Ledger(log=log))
    r = _gate(path, "--requests", "3")
    assert r.exit_code == 1 and "FAIL  log_integrity" in r.output and "not closed" in r.output
    assert len(replay(path).accounts) == 3
    log.close()
    assert _gate(path, "--requests", "3").exit_code == 0


def test_a_recomputed_chain_is_caught_only_by_an_external_head(tmp_path):
    """What the chain does not cover: a writer that rebuilds the whole log. The head kept outside catches it."""
    failing = closed_log(tmp_path / "failing.db", fail=True)
    _, reader = replay_verified(failing)
    anchor = f"{reader.seq}:{reader.prev.hex()}"
    rebuilt = closed_log(tmp_path / "rebuilt.db", fail=False)  # the same requests without the failing events
    assert _gate(rebuilt).exit_code == 0
    r = _gate(rebuilt, "--expect-head", anchor)
    assert r.exit_code == 1 and "FAIL  log_head==expected" in r.output
    # the head is unique per log (a random log id enters the genesis): equal events, different heads
    again = closed_log(tmp_path / "again.db", fail=True)
    assert replay_verified(again)[1].prev != reader.prev


def test_run_directory_snapshot_must_equal_its_log(tmp_path):
    log = EventLog(tmp_path / "ledger.db")
    led = Ledger(log=log)
    run_requests(led)
    led.save(tmp_path / "ledger.json")
    log.close()
    r = _gate(tmp_path, "--requests", "3")
    assert r.exit_code == 0 and "PASS  ledger.json==replay(ledger.db)" in r.output
    snap = (tmp_path / "ledger.json").read_text().replace('"n_read_foreign_owner": 0', '"n_read_foreign_owner": 0 ', 1)
    (tmp_path / "ledger.json").write_text(snap)  # formatting is not content
    assert _gate(tmp_path).exit_code == 0
    data = json.loads(snap)
    data["accounts"]["0"]["n_reads"] += 1
    (tmp_path / "ledger.json").write_text(json.dumps(data))
    r = _gate(tmp_path)
    assert r.exit_code == 1 and "FAIL  ledger.json==replay(ledger.db)" in r.output and "n_reads" in r.output


def test_chain_metadata_is_written_once(tmp_path):
    log = closed_log(tmp_path / "ledger.db")
    meta = meta_of(log)
    assert meta["chain"]["version"] == 1 and len(meta["chain"]["log_id"]) == 32
    assert meta["head"]["seq"] == 9
    assert LogReader(log).path == log


def test_expect_head_needs_a_single_log(tmp_path):
    (tmp_path / "rank0").mkdir()
    closed_log(tmp_path / "rank0" / "ledger.db")
    _one_line_failure(_gate(tmp_path, "--expect-head", "1:00"), 2, "--expect-head names one log's head")
    led = Ledger()
    run_requests(led)
    led.save(tmp_path / "s.json")
    _one_line_failure(_gate(tmp_path / "s.json", "--expect-head", "1:00"), 2, "needs an event log")
