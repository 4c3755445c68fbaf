"""Append-only SQLite (WAL) event log; every append is one atomic transaction.

A process killed mid-append (``kill -9``) leaves the last transaction uncommitted; SQLite rolls it back
on the next open, so replay sees every committed event and nothing half-written.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvcert.ledger.events import Event, Row, decode, encode

_SCHEMA = """CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, meta TEXT NOT NULL,
  a BLOB, b BLOB, c BLOB, d BLOB)"""
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
_INSERT = "INSERT INTO events (kind, meta, a, b, c, d) VALUES (?, ?, ?, ?, ?, ?)"


class EventLog:
    """An append-only event log in SQLite WAL mode at ``path``.

    ``synchronous="NORMAL"`` (default) is durable against process crashes; use ``"FULL"`` to also survive
    power loss.
    """

    def __init__(self, path: str | Path, synchronous: str = "NORMAL") -> None:
        if synchronous not in {"OFF", "NORMAL", "FULL"}:
            raise ValueError(f"synchronous must be OFF, NORMAL or FULL, got {synchronous!r}")
        self.path = Path(path)
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._conn.execute(_SCHEMA)
        self._conn.execute(_META)
        self._lock = threading.Lock()

    def set_meta(self, values: dict[str, Any]) -> None:
        """Store configuration (JSON values) the replay needs, e.g. the ledger's ``delta_e``."""
        with self._lock:
            self._conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def append(self, event: Event) -> None:
        """Commit one event atomically."""
        row = encode(event)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(_INSERT, row)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def append_many(self, events: Iterable[Event]) -> None:
        """Commit many events in one atomic transaction (all or none)."""
        self.append_rows(encode(e) for e in events)

    def append_rows(self, rows: Iterable[Row]) -> None:
        """Commit pre-encoded rows in one atomic transaction (bulk generation, benchmarks)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(_INSERT, rows)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def __iter__(self) -> Iterator[Event]:
        """Committed events in append order (a read snapshot taken when iteration starts)."""
        return read_events(self.path)

    def close(self) -> None:
        """Close the connection (checkpointing the WAL)."""
        with self._lock:
            self._conn.close()


def read_events(path: str | Path) -> Iterator[Event]:
    """Iterate the committed events of an existing log file (events are never modified)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"log path {str(p)!r} is not a file")
    conn = sqlite3.connect(str(p))  # a writable open lets SQLite roll back a torn WAL tail
    try:
        try:
            cursor = conn.execute("SELECT kind, meta, a, b, c, d FROM events ORDER BY seq")
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"log {str(p)!r} is not a kvcert ledger log: {exc}") from exc
        for row in cursor:
            yield decode(row)
    finally:
        conn.close()


def read_meta(path: str | Path) -> dict[str, Any]:
    """The configuration stored with :meth:`EventLog.set_meta` (empty if none)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"log path {str(p)!r} is not a file")
    conn = sqlite3.connect(str(p))
    try:
        try:
            rows = conn.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"log {str(p)!r} is not a kvcert ledger log: {exc}") from exc
        return {k: json.loads(v) for k, v in rows}
    finally:
        conn.close()
