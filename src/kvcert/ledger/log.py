"""Append-only SQLite (WAL) event log; every commit is one atomic transaction.

Two commit modes:

* **synchronous** (default): ``append`` commits the event in its own transaction before returning.
* **background** (``background=True``, group commit): ``append`` encodes the event in the caller and
  queues it (no wake-up, no I/O); one writer thread commits everything queued in **one** transaction
  (``executemany``), in append order, at least every ``max_delay_s`` seconds, when :meth:`EventLog.flush`
  asks, or when ``max_pending`` groups wait (then appending blocks until they are committed). An event is
  durable once ``flush()`` (or ``close()``) returns.

Crash semantics (both modes): a process killed mid-commit (``kill -9``) leaves the last transaction
uncommitted and SQLite rolls it back on the next open, so replay sees a **prefix** of the appended events:
every committed event, and nothing half-written (a group from ``append_many`` is all or none). In
background mode the lost tail is what was queued but not yet committed (at most ``max_pending`` groups,
at most ``max_delay_s`` old unless the writer is busy committing).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from kvcert.ledger.events import Event, Row, decode, encode

_SCHEMA = """CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, meta TEXT NOT NULL,
  a BLOB, b BLOB, c BLOB, d BLOB)"""
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
_INSERT = "INSERT INTO events (kind, meta, a, b, c, d) VALUES (?, ?, ?, ?, ?, ?)"


def _commit_rows(conn: sqlite3.Connection, lock: threading.Lock, rows: Iterable[Row]) -> None:
    """Insert ``rows`` in one transaction (all or none)."""
    with lock:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_INSERT, rows)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


@dataclass
class _Queue:
    """State shared by a background :class:`EventLog` and its writer thread (no reference to the log, so
    an unreferenced log is finalised: its queue is committed and the writer stopped)."""

    conn: sqlite3.Connection
    lock: threading.Lock
    max_pending: int
    max_delay_s: float
    groups: deque[list[Row]] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    wake: threading.Event = field(default_factory=threading.Event)
    appended: int = 0  # groups queued so far
    committed: int = 0  # groups the writer has taken and committed (or discarded after a failure)
    stop: bool = False
    error: BaseException | None = None

    def put(self, rows: list[Row]) -> None:
        with self.cond:
            while len(self.groups) >= self.max_pending and not self.stop:  # back-pressure
                self.wake.set()
                self.cond.wait()
            self.groups.append(rows)
            self.appended += 1

    def wait_committed(self) -> None:
        """Block until every group queued before the call is committed (or the writer failed/stopped)."""
        with self.cond:
            target = self.appended
            self.wake.set()
            while self.committed < target:
                self.cond.wait()

    def drain(self) -> None:
        """Writer thread: commit every queued group in one transaction, in append order, until stopped."""
        while True:
            self.wake.wait(self.max_delay_s)
            self.wake.clear()
            with self.cond:
                groups = list(self.groups)
                self.groups.clear()
                stop = self.stop
            if groups and self.error is None:
                try:
                    _commit_rows(self.conn, self.lock, chain.from_iterable(groups))
                except BaseException as exc:  # surfaced to the appending thread
                    self.error = exc
            with self.cond:
                self.committed += len(groups)
                self.cond.notify_all()
            if stop:
                return

    def shutdown(self, writer: threading.Thread) -> None:
        """Commit what is queued and end the writer (also run when the log is finalised or at exit)."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.wake.set()
        writer.join()


class EventLog:
    """An append-only event log in SQLite WAL mode at ``path``.

    ``synchronous="NORMAL"`` (default) is durable against process crashes; use ``"FULL"`` to also survive
    power loss. ``background=True`` selects group commit by a writer thread (see the module docstring);
    a writer failure is raised by the next ``append``, :meth:`flush` or :meth:`close`.
    """

    def __init__(
        self,
        path: str | Path,
        synchronous: str = "NORMAL",
        background: bool = False,
        max_pending: int = 4096,
        max_delay_s: float = 0.2,
    ) -> None:
        if synchronous not in {"OFF", "NORMAL", "FULL"}:
            raise ValueError(f"synchronous must be OFF, NORMAL or FULL, got {synchronous!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if not max_delay_s > 0:
            raise ValueError(f"max_delay_s must be > 0, got {max_delay_s}")
        self.path = Path(path)
        self.background = background
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._conn.execute(_SCHEMA)
        self._conn.execute(_META)
        self._lock = threading.Lock()
        self._closed = False
        self._queue: _Queue | None = None
        if background:
            self._queue = _Queue(self._conn, self._lock, max_pending, max_delay_s)
            writer = threading.Thread(target=self._queue.drain, name="kvcert-event-log", daemon=True)
            writer.start()
            self._finalizer = weakref.finalize(self, self._queue.shutdown, writer)

    def set_meta(self, values: dict[str, Any]) -> None:
        """Store configuration (JSON values) the replay needs, e.g. the ledger's ``delta_e``."""
        with self._lock:
            self._conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def append(self, event: Event) -> None:
        """Commit one event atomically (background mode: queue it for the next group commit)."""
        self._submit([encode(event)])

    def append_many(self, events: Iterable[Event]) -> None:
        """Commit many events in one atomic transaction (all or none)."""
        self._submit([encode(e) for e in events])

    def append_rows(self, rows: Iterable[Row]) -> None:
        """Commit pre-encoded rows in one atomic transaction (bulk generation, benchmarks)."""
        self._submit(list(rows))

    def flush(self) -> None:
        """Return once every event appended so far is committed (immediate in synchronous mode)."""
        if self._queue is not None and not self._closed:
            self._queue.wait_committed()
        self._raise_writer_error()

    def _submit(self, rows: list[Row]) -> None:
        if self._closed:
            raise ValueError(f"event log {str(self.path)!r} is closed")
        self._raise_writer_error()
        if self._queue is not None:
            self._queue.put(rows)
        else:
            _commit_rows(self._conn, self._lock, rows)

    def _raise_writer_error(self) -> None:
        if self._queue is not None and self._queue.error is not None:
            raise RuntimeError(
                f"event log writer failed; events after the failure were not committed: {self._queue.error!r}"
            ) from self._queue.error

    def __len__(self) -> int:
        self.flush()
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def __iter__(self) -> Iterator[Event]:
        """Committed events in append order (a read snapshot taken when iteration starts)."""
        self.flush()
        return read_events(self.path)

    def close(self) -> None:
        """Commit what is queued, stop the writer and close the connection (checkpointing the WAL)."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:
            self._finalizer()  # runs shutdown once: commits the queue, joins the writer
        with self._lock:
            self._conn.close()
        self._raise_writer_error()


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
