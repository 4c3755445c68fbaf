"""Issue 21, evidence fuzz harness (hypothesis): tampered and malformed ledger logs, gate snapshots and probe
snapshots. Properties, per generated case:

* no tampered artefact passes: every edit of a closed log or of a written probe snapshot, and every edit of
  a run directory's ``ledger.json`` against its log, is refused (gate exit 1 or 2; verify not ok);
* clean errors: the only exceptions are the documented ones (:class:`~kvcert.ledger.events.LogError`,
  :class:`~kvcert.probe.snapshot.SnapshotError`, :class:`~kvcert.strict_json.StrictJSONError`); the CLI
  never shows a traceback; nothing allocates more than the slot bound allows (each case is timed).

Examples are derandomised (the same cases in every CI run) and bounded to keep each test to seconds.
"""

import json
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from evidence_logs import closed_log, forged_log, rows, run_requests
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from snapshot_factory import good_dict
from typer.testing import CliRunner

from kvcert.cli.ledger_command import app
from kvcert.ledger import EventLog, Ledger, replay
from kvcert.ledger.events import RULES, FaultReport, LogError, OpenRequest, SlotRead, SlotWrite
from kvcert.probe import ProbeSnapshot, SnapshotError, verify_file
from kvcert.strict_json import StrictJSONError
from kvcert.strict_json import loads as strict_loads

runner = CliRunner()
EXAMPLES = int(os.environ.get("KVCERT_FUZZ_EXAMPLES", "40"))  # CI: 40 per property; deeper runs: docs/reliability.md
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 40, suppress_health_check=[HealthCheck.too_slow]
)
CASE_SECONDS = 5.0


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A closed log that fails the gate (a fail-closed write and a foreign read): 15 events."""
    return closed_log(tmp_path_factory.mktemp("genuine") / "ledger.db", n=4, fail=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A passing run directory: ledger.json saved from the live ledger, ledger.db its closed log."""
    d = tmp_path_factory.mktemp("rundir")
    log = EventLog(d / "ledger.db")
    led = Ledger(log=log)
    run_requests(led, 3)
    led.save(d / "ledger.json")
    log.close()
    return d


def _refused(result) -> None:
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


TAMPER = st.one_of(
    st.tuples(st.just("delete"), st.integers(1, 15)),
    st.tuples(st.just("swap"), st.integers(1, 15), st.integers(1, 15)),
    st.tuples(st.just("duplicate"), st.integers(1, 15)),
    st.tuples(
        st.just("flip"),
        st.integers(1, 15),
        st.sampled_from("meta a b c d h".split()),
        st.integers(0, 10**6),
        st.integers(1, 255),
    ),
    st.tuples(st.just("renumber"), st.integers(1, 15), st.integers(-3, 40)),
    st.tuples(st.just("truncate"), st.integers(1, 14), st.booleans()),
    st.tuples(
        st.just("config"),
        st.sampled_from(["delta_req", "delta_e", "model", "max_incidents", "rank"]),
        st.sampled_from(["0.5", "1", '"x"', "null", "0.010000001"]),
    ),
)


def _apply(conn: sqlite3.Connection, op: tuple) -> None:
    kind = op[0]
    if kind == "delete":
        conn.execute("DELETE FROM events WHERE seq = ?", (op[1],))
    elif kind == "swap":
        assume(op[1] != op[2])
        a, b = (
            conn.execute("SELECT kind, meta, a, b, c, d, h FROM events WHERE seq = ?", (s,)).fetchone() for s in op[1:]
        )
        assume(a is not None and b is not None and a != b)
        for seq, row in ((op[1], b), (op[2], a)):
            conn.execute("UPDATE events SET kind=?, meta=?, a=?, b=?, c=?, d=?, h=? WHERE seq = ?", (*row, seq))
    elif kind == "duplicate":
        end = conn.execute("SELECT MAX(seq) FROM events").fetchone()[0] or 0
        conn.execute(
            "INSERT INTO events SELECT ?, kind, meta, a, b, c, d, h FROM events WHERE seq = ?", (end + 1, op[1])
        )
    elif kind == "flip":
        _, seq, col, pos, mask = op
        found = conn.execute(f"SELECT {col} FROM events WHERE seq = ?", (seq,)).fetchone()
        assume(found is not None and found[0] is not None and len(found[0]) > 0)
        value = found[0]
        raw = bytearray(value.encode() if isinstance(value, str) else value)
        raw[pos % len(raw)] ^= mask
        new = bytes(raw)
        if isinstance(value, str):
            try:
                new = new.decode()
            except UnicodeDecodeError:
                assume(False)
        conn.execute(f"UPDATE events SET {col} = ? WHERE seq = ?", (new, seq))
    elif kind == "renumber":
        assume(op[1] != op[2])
        clash = conn.execute("SELECT 1 FROM events WHERE seq = ?", (op[2],)).fetchone()
        assume(clash is None)
        conn.execute("UPDATE events SET seq = ? WHERE seq = ?", (op[2], op[1]))
    elif kind == "truncate":
        conn.execute("DELETE FROM events WHERE seq > ?", (op[1],))
        if op[2]:
            conn.execute("DELETE FROM meta WHERE key = 'head'")
    else:
        old = conn.execute("SELECT value FROM meta WHERE key = ?", (op[1],)).fetchone()[0]
        assume(json.loads(old) != json.loads(op[2]) or old != op[2] and not isinstance(json.loads(old), float))
        conn.execute("UPDATE meta SET value = ? WHERE key = ?", (op[2], op[1]))


@FUZZ
@given(ops=st.lists(TAMPER, min_size=1, max_size=3))
def test_no_tampered_log_passes_the_gate(genuine, ops):
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "ledger.db"
        shutil.copy(genuine, bad)
        conn = sqlite3.connect(bad)
        for op in ops:
            _apply(conn, op)
        conn.commit()
        conn.close()
        assume(rows(bad) != rows(genuine) or _meta(bad) != _meta(genuine))
        start = time.perf_counter()
        result = runner.invoke(app, ["gate", str(bad)])
        _refused(result)
        event(f"gate exit {result.exit_code}")
        try:
            replay(bad)
        except LogError:
            pass
        assert time.perf_counter() - start < CASE_SECONDS


def _meta(path: Path) -> dict:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT key, value FROM meta").fetchall())
    finally:
        conn.close()


INTS = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**63), -5, 2**26 - 1, 2**26, 10**12, 2**62]))


def _arr(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@st.composite
def events(draw):
    kind = draw(st.sampled_from(["open", "write", "read", "fault"]))
    if kind == "open":
        return OpenRequest(draw(INTS), draw(st.sampled_from([0.01, 0.5, 0.0, 1.5, float("nan")])))
    pool = draw(st.sampled_from(["k", "v", ""]))
    layer = draw(st.integers(-1, 3))
    if kind == "fault":
        return FaultReport("x", pool, layer, draw(INTS))
    n = draw(st.integers(0, 4))
    if kind == "write":
        states = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
        factors = draw(st.lists(st.sampled_from([float("nan"), 0.1, float("inf")]), min_size=n, max_size=n))
        return SlotWrite(
            pool,
            layer,
            _arr(draw(st.lists(INTS, min_size=n, max_size=n))),
            _arr(draw(st.lists(st.integers(-2, 4), min_size=n, max_size=n))),
            np.array(states, dtype=np.uint8),
            draw(st.sampled_from(RULES)),
            np.array(factors, dtype=np.float64),
        )
    cols = [_arr(draw(st.lists(INTS, min_size=n, max_size=n))) for _ in range(5)]
    return SlotRead(pool, layer, *cols, draw(st.booleans()))


@FUZZ
@given(evs=st.lists(events(), min_size=1, max_size=8))
def test_forged_event_sequences_fail_cleanly(evs):
    """Events chosen freely under an intact chain (a writer that recomputes it): replay applies what the live
    API could have logged and refuses the rest with a LogError naming the seq; nothing else escapes."""
    with tempfile.TemporaryDirectory() as tmp:
        log = forged_log(Path(tmp) / "f.db", evs)
        start = time.perf_counter()
        try:
            led = replay(log)
        except LogError as exc:
            assert "event seq" in str(exc) and "\n" not in str(exc)
            event("replay refused (LogError)")
        else:
            event("replay applied (valid events)")
            for table in led.tables.values():
                assert table.state.shape[0] <= 2**26
        assert time.perf_counter() - start < CASE_SECONDS
        _refused_or_passed = runner.invoke(app, ["gate", str(log)])
        assert "Traceback" not in _refused_or_passed.output


ROWS = st.tuples(
    st.sampled_from(["open", "write", "read", "fault", "bogus", ""]),
    st.one_of(
        st.text(max_size=30),
        st.just('["k", 0, "deterministic", false]'),
        st.just('["k", 0, false, false]'),
        st.just("[0, 0.01]"),
        st.just('["x", "k", 0, 1, ""]'),
    ),
    *(st.one_of(st.none(), st.binary(max_size=40)) for _ in range(4)),
)


@FUZZ
@given(raw=st.lists(ROWS, min_size=1, max_size=5))
def test_malformed_rows_fail_cleanly(raw):
    with tempfile.TemporaryDirectory() as tmp:
        log = forged_log(Path(tmp) / "m.db", [OpenRequest(0, 0.01), *raw])
        try:
            replay(log)
        except LogError as exc:
            assert "event seq" in str(exc)
        _ = runner.invoke(app, ["gate", str(log)])
        assert "Traceback" not in _.output and (_.exception is None or isinstance(_.exception, SystemExit))


PATHS_IN = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "accounts",
                "global",
                "eprocess",
                "rank",
                "n_ranks",
                "0",
                "1",
                "n_reads",
                "n_read_stale",
                "delta_spent",
                "crossed",
                "uid",
            ]
        )
    ),
    min_size=1,
    max_size=3,
)
VALUES = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def _set(data: dict, path: list[str], value: object) -> bool:
    cur = data
    for key in path[:-1]:
        if not isinstance(cur, dict) or key not in cur:
            return False
        cur = cur[key]
    if not isinstance(cur, dict):
        return False
    cur[path[-1]] = value
    return True


@FUZZ
@given(edits=st.lists(st.tuples(PATHS_IN, VALUES), min_size=1, max_size=3))
def test_gate_snapshots_fail_cleanly_and_an_edited_run_never_passes(run_dir, edits):
    original = json.loads((run_dir / "ledger.json").read_text())
    data = json.loads(json.dumps(original))
    changed = any([_set(data, path, value) for path, value in edits])
    assume(changed)
    text = json.dumps(data)
    assume(json.loads(text) != original)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "ledger.json").write_text(text)
        bare = runner.invoke(app, ["gate", str(d / "ledger.json")])  # a bare snapshot: clean, whatever it says
        assert "Traceback" not in bare.output and (bare.exception is None or isinstance(bare.exception, SystemExit))
        shutil.copy(run_dir / "ledger.db", d / "ledger.db")
        _refused(runner.invoke(app, ["gate", str(d)]))  # against its log: never passes


def _probe_file(tmp: Path) -> Path:
    return ProbeSnapshot.from_dict(good_dict()).write(tmp / "p.json")


SNAP_PATHS = st.lists(
    st.sampled_from(
        [
            "readings",
            "0",
            "3",
            "value",
            "layer",
            "metric",
            "name",
            "tier",
            "kind",
            "declared",
            "layers",
            "paths",
            "self_checks",
            "witness_violations",
            "triggers",
            "model",
        ]
    ),
    min_size=1,
    max_size=3,
)


@FUZZ
@given(edits=st.lists(st.tuples(SNAP_PATHS, VALUES), min_size=1, max_size=3))
def test_no_edited_probe_snapshot_verifies(edits):
    with tempfile.TemporaryDirectory() as tmp:
        path = _probe_file(Path(tmp))
        data = json.loads(path.read_text())
        original = json.loads(json.dumps(data))
        for keys, value in edits:
            cur = data
            for key in keys[:-1]:
                cur = (
                    cur[int(key)]
                    if isinstance(cur, list) and key.isdigit() and int(key) < len(cur)
                    else (cur.get(key) if isinstance(cur, dict) else None)
                )
            if isinstance(cur, dict):
                cur[keys[-1]] = value
        text = json.dumps(data)
        assume(json.loads(text) != original)
        path.write_text(text)
        r = verify_file(path)
        assert not r.ok and r.stage in ("schema", "integrity"), r


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
        st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
        st.integers(1, 50).map(lambda n: '{"a": 1, ' * n + '"a": 2' + "}" * n),
    )
)
def test_arbitrary_text_parses_or_fails_with_the_documented_error(text):
    try:
        strict_loads(text)
    except StrictJSONError as exc:
        assert "\n" not in str(exc)
    try:
        ProbeSnapshot.from_json(text)
    except SnapshotError:
        pass
