"""Issue 21, evidence: one writer per log. Reusing a path never merges two ledgers silently; a resumed log
continues its chain and its request ids; a second writer (thread or process) is refused."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from evidence_logs import closed_log, edit, run_requests

from kvcert.ledger import EventLog, Ledger, replay
from kvcert.ledger.log import LogExistsError, LogIntegrityError, LogInUseError
from kvcert.ledger.replay import replay_verified

SRC = str(Path(__file__).resolve().parents[2] / "src")
HELPERS = str(Path(__file__).resolve().parent)


def test_reusing_a_path_is_refused_and_resume_continues_ids(tmp_path):
    path = closed_log(tmp_path / "ledger.db")
    with pytest.raises(LogExistsError, match="already exists; open it with resume=True"):
        EventLog(path)
    log = EventLog(path, resume=True)
    led = Ledger(log=log)
    assert sorted(led.accounts) == [0, 1, 2] and led.uids.next_uid == 3
    run_requests(led)  # request ids carry on: 3, 4, 5
    log.close()
    rebuilt, reader = replay_verified(path)
    assert sorted(rebuilt.accounts) == [0, 1, 2, 3, 4, 5] and reader.closed and reader.seq == 18
    assert rebuilt.summary()["n_reads"] == 48  # both runs' reads, each under its own request


def test_resume_with_another_configuration_or_a_tampered_log_is_refused(tmp_path):
    path = closed_log(tmp_path / "ledger.db")
    log = EventLog(path, resume=True)
    with pytest.raises(ValueError, match="another configuration: delta_req 0.01 != 0.02"):
        Ledger(delta_req=0.02, log=log)
    log.close()
    bad = edit(path, tmp_path / "bad.db", ("DELETE FROM events WHERE seq = 2", ()))
    with pytest.raises(LogIntegrityError, match="event seq 2"):
        EventLog(bad, resume=True)
    EventLog(bad.with_name("fresh.db"), resume=True).close()  # resume of nothing starts a new log


def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    path = tmp_path / "ledger.db"
    log = EventLog(path)
    Ledger(log=log).open_request()
    with pytest.raises(LogInUseError, match="in use by another ledger"):
        EventLog(path, resume=True)
    log.close()
    EventLog(path, resume=True).close()  # free again once closed


_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [{src!r}, {helpers!r}]
    from evidence_logs import run_requests
    from kvcert.ledger import EventLog, Ledger
    from kvcert.ledger.events import LogError
    try:
        log = EventLog(sys.argv[1])
    except LogError as exc:
        print("REFUSED", type(exc).__name__, flush=True)
        sys.exit(3)
    print("OWNER", flush=True)
    run_requests(Ledger(log=log), 5)
    time.sleep(float(sys.argv[2]))
    log.close()
    """
)


def test_concurrent_processes_on_one_path_the_second_refuses(tmp_path):
    path = tmp_path / "ledger.db"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(src=SRC, helpers=HELPERS))
    first = subprocess.Popen([sys.executable, str(script), str(path), "3"], stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None and first.stdout.readline().strip() == "OWNER"
    others = [
        subprocess.run([sys.executable, str(script), str(path), "0"], capture_output=True, text=True) for _ in range(2)
    ]
    assert first.wait() == 0
    for r in others:
        assert r.returncode == 3 and r.stdout.strip() in {"REFUSED LogInUseError", "REFUSED LogExistsError"}, r
        assert "Traceback" not in r.stderr
    assert sorted(replay(path).accounts) == [0, 1, 2, 3, 4]  # one run's requests, nothing merged


def test_a_crashed_writer_releases_the_log_for_resume(tmp_path):
    path = tmp_path / "ledger.db"
    code = f"import sys, os; sys.path[:0] = [{SRC!r}, {HELPERS!r}]\n" + textwrap.dedent(
        """
        from evidence_logs import run_requests
        from kvcert.ledger import EventLog, Ledger
        run_requests(Ledger(log=EventLog(sys.argv[1])), 2)
        os._exit(0)  # no close: no head recorded, the lock dies with the process
        """
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    assert not replay_verified(path)[1].closed
    log = EventLog(path, resume=True)
    led = Ledger(log=log)
    assert led.open_request() == 2
    log.close()
    assert replay_verified(path)[1].closed
