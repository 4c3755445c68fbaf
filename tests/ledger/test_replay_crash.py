import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ledger_workload import run_workload

from kvcert.ledger import EventLog, Ledger, diff_states, read_events, replay
from kvcert.ledger.events import OpenRequest, encode
from kvcert.ledger.log import LogIntegrityError

HERE = Path(__file__).parent


def test_replay_equals_live_field_for_field(tmp_path):
    log = EventLog(tmp_path / "ledger.db")
    live = Ledger(log=log)
    run_workload(live, 12)
    live.report_fault("corrupt_code", "k", 0, 3, "test")
    snap = json.loads(json.dumps(live.snapshot()))
    log.close()
    rebuilt = replay(tmp_path / "ledger.db")
    assert diff_states(snap, json.loads(json.dumps(rebuilt.snapshot()))) == []
    assert rebuilt.eprocess.n_factors > 0 and snap["eprocess"]["n_factors"] == rebuilt.eprocess.n_factors
    # replayed UIDs are never reissued
    assert rebuilt.open_request() == 12


def test_replay_detects_a_lost_event(tmp_path):
    log = EventLog(tmp_path / "ledger.db")
    live = Ledger(log=log)
    run_workload(live, 4)
    log.close()
    conn = sqlite3.connect(tmp_path / "ledger.db")
    conn.execute("DELETE FROM events WHERE seq = (SELECT MAX(seq) FROM events WHERE kind = 'read')")
    conn.commit()
    conn.close()
    # issue 21: a lost event used to replay silently to a different state; the chain now refuses the log
    with pytest.raises(LogIntegrityError, match=r"event seq \d+: the head recorded at close"):
        replay(tmp_path / "ledger.db")


@pytest.mark.parametrize("mode", ["sync", "background"])
def test_kill_9_recovers_every_committed_event(tmp_path, mode):
    path = tmp_path / "ledger.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen(
        [sys.executable, str(HERE / "crash_child.py"), str(path), str(HERE), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    last = -1
    assert child.stdout is not None
    for line in child.stdout:
        last = int(line)
        if last >= 25:
            break
    assert last >= 25, "the child died before committing enough iterations"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    events = list(read_events(path))
    # every event committed before the last printed iteration is there, in order, exactly as generated
    reference_log = EventLog(tmp_path / "ref.db")
    boundary: list[int] = []
    run_workload(Ledger(log=reference_log), last + 3, on_commit=lambda i: boundary.append(len(reference_log)))
    reference_log.close()
    ref = list(read_events(tmp_path / "ref.db"))
    mine = [e for e in events if getattr(e, "kind", None) != "marker"]
    assert len(mine) >= boundary[last]  # every event of every printed iteration was recovered
    for a, b in zip(mine, ref, strict=False):
        ea, eb = encode(a), encode(b)
        assert ea == eb
    markers = [e for e in events if getattr(e, "kind", None) == "marker"]
    assert len(markers) % 10 == 0 and len(markers) >= 10 * (last + 1)  # nothing half-written
    rebuilt = replay(path)
    assert rebuilt.counters["fault:marker"] == len(markers)
    assert len(rebuilt.accounts) >= last + 1
    for uid in range(last + 1):
        c = rebuilt.accounts[uid].counts
        assert c["n_written"] == 16 + (uid % 3 == 2) and c["n_reads"] == 20


@pytest.mark.parametrize("bad", ["missing.db", "notalog.db"])
def test_replay_rejects_bad_logs(tmp_path, bad):
    p = tmp_path / bad
    if bad == "notalog.db":
        p.write_text("hello")
    with pytest.raises(ValueError, match="log"):
        replay(p)


def test_background_log_commits_the_same_events_and_replays_equal(tmp_path):
    log = EventLog(tmp_path / "bg.db", background=True, max_pending=4)
    live = Ledger(log=log)
    run_workload(live, 12)
    live.save(tmp_path / "live.json")  # flushes first: the saved state and the log agree
    rebuilt = replay(tmp_path / "bg.db")
    saved = json.loads((tmp_path / "live.json").read_text())
    assert diff_states(saved, json.loads(json.dumps(rebuilt.snapshot()))) == []
    log.close()
    ref = EventLog(tmp_path / "sync.db")
    run_workload(Ledger(log=ref), 12)
    ref.close()
    # group commit changes when events become durable, never which events or their order
    grouped = [encode(e) for e in read_events(tmp_path / "bg.db")]
    assert grouped == [encode(e) for e in read_events(tmp_path / "sync.db")]


def test_background_log_surfaces_a_writer_failure(tmp_path):
    path = tmp_path / "bg.db"
    log = EventLog(path, background=True)
    led = Ledger(log=log)
    uid = led.open_request()
    led.flush()
    other = sqlite3.connect(path)
    other.execute("DROP TABLE events")  # the writer's next commit fails
    other.commit()
    other.close()
    led.read("k", 0, np.array([uid]), np.array([0]), np.array([1]))
    with pytest.raises(RuntimeError, match="writer failed"):
        led.flush()
    with pytest.raises(RuntimeError, match="writer failed"):
        led.open_request()
    with pytest.raises(RuntimeError, match="writer failed"):
        log.close()
    with pytest.raises(ValueError, match="closed"):
        log.append(OpenRequest(99, 0.01))
    with pytest.raises(ValueError, match="max_pending"):
        EventLog(tmp_path / "x.db", background=True, max_pending=0)
