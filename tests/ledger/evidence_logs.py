"""Builders of genuine ledger logs and of tampered copies (shared by the integrity tests and the fuzz harness)."""

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np

from kvcert.ledger import DitheredAdmission, EventLog, Ledger, observed
from kvcert.ledger.events import encode

LEGACY_SCHEMA = """CREATE TABLE events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, meta TEXT NOT NULL,
  a BLOB, b BLOB, c BLOB, d BLOB)"""


def run_requests(ledger: Ledger, n: int = 3, fail: bool = False) -> None:
    """``n`` requests each writing 8 dithered entries and reading them; ``fail`` adds a fail-closed write and
    a foreign read (the gate must fail on either)."""
    rng = np.random.default_rng(3)
    uids = []
    for i in range(n):
        uid = ledger.open_request()
        uids.append(uid)
        adm = DitheredAdmission(rng.normal(size=(8, 4)), np.full((8, 4), 0.02), threshold=0.5, rng=rng)
        ledger.write("k", 0, np.arange(8) + 8 * i, np.full(8, uid), adm, rule="probabilistic")
        ledger.read("k", 0, np.array([uid]), np.array([8 * i]), np.array([8]))
    if fail:
        ledger.write("k", 1, np.arange(2), np.full(2, -1), observed(np.ones(2, bool)))
        ledger.read("k", 0, np.array([uids[-1]]), np.array([0]), np.array([8]))  # request 0's entries


def closed_log(path: Path, n: int = 3, fail: bool = False) -> Path:
    """A genuine, closed log of :func:`run_requests`."""
    log = EventLog(path)
    run_requests(Ledger(log=log), n, fail)
    log.close()
    return path


def rows(path: Path) -> list[tuple]:
    """``(seq, kind, meta, a, b, c, d, h)`` of every row, in order."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT seq, kind, meta, a, b, c, d, h FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()


def edit(src: Path, dst: Path, *statements: tuple[str, tuple]) -> Path:
    """A copy of the log ``src`` at ``dst`` with SQL ``statements`` applied (a hand edit of the evidence)."""
    shutil.copy(src, dst)
    conn = sqlite3.connect(dst)
    try:
        for sql, args in statements:
            conn.execute(sql, args)
        conn.commit()
    finally:
        conn.close()
    return dst


def legacy_copy(src: Path, dst: Path) -> Path:
    """The events and configuration of ``src`` in the schema kvcert wrote before the hash chain."""
    conn = sqlite3.connect(dst)
    try:
        conn.execute(LEGACY_SCHEMA)
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        for _, kind, meta, a, b, c, d, _ in rows(src):
            conn.execute(
                "INSERT INTO events (kind, meta, a, b, c, d) VALUES (?, ?, ?, ?, ?, ?)", (kind, meta, a, b, c, d)
            )
        old = sqlite3.connect(src)
        for k, v in old.execute("SELECT key, value FROM meta").fetchall():
            if k not in ("chain", "head"):
                conn.execute("INSERT INTO meta VALUES (?, ?)", (k, v))
        old.close()
        conn.commit()
    finally:
        conn.close()
    return dst


def forged_log(path: Path, events: list, config: dict | None = None) -> Path:
    """A log whose chain is intact but whose events are chosen freely (what a buggy or hostile writer that
    recomputes the chain produces): only the per-event validation can refuse it."""
    log = EventLog(path)
    log.set_meta(
        config or {"delta_req": 0.01, "delta_e": 0.01, "model": "m", "max_incidents": 8, "rank": 0, "n_ranks": 1}
    )
    log.append_rows(encode(e) if not isinstance(e, tuple) else e for e in events)
    log.close()
    return path


def meta_of(path: Path) -> dict:
    conn = sqlite3.connect(path)
    try:
        return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta").fetchall()}
    finally:
        conn.close()
