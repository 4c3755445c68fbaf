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

Tamper evidence (hash chain, ``docs/ledger.md`` "Tamper evidence"): row ``seq`` (1, 2, 3, … with no gap)
stores ``h_seq = SHA-256(h_{seq-1} ‖ seq ‖ row)``, where ``h_0`` hashes a random log id and the ledger
configuration stored with :meth:`EventLog.set_meta`. :meth:`EventLog.close` records the head
``(seq, h_seq)``. :class:`LogReader` recomputes the chain while it reads and raises :class:`LogIntegrityError`
at the first row whose sequence number or hash does not match, so deleting, inserting, reordering or
rewriting any committed row, or editing the configuration, is detected; removing rows from the end is
detected against the recorded head (or an externally kept copy of it). A log written before the chain
existed (no ``h`` column) is read as an *unchained legacy log* whose integrity cannot be verified.

Ownership: a log has one writer. :class:`EventLog` holds an exclusive ``flock`` on ``<path>.lock`` while it
is open (a second writer, in this process or another, gets :class:`LogInUseError`) and refuses a path that
already holds a log (:class:`LogExistsError`) unless it is opened with ``resume=True``, which verifies the
chain and continues it (a :class:`~kvcert.ledger.ledger.Ledger` on a resumed log continues its request ids).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sqlite3
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from kvcert.ledger.events import Event, LogError, Row, decode, encode

_SCHEMA = """CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, meta TEXT NOT NULL,
  a BLOB, b BLOB, c BLOB, d BLOB, h BLOB NOT NULL)"""
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
_INSERT = "INSERT INTO events (seq, kind, meta, a, b, c, d, h) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
CHAIN_KEY, HEAD_KEY = "chain", "head"
"""Meta keys of the chain's log id and of the head recorded at close (not part of the configuration)."""
_CHAIN_TAG = b"kvcert.ledger.chain/1\x00"

ChainedRow = tuple[int, str, str, bytes | None, bytes | None, bytes | None, bytes | None, bytes]


class LogIntegrityError(LogError):
    """The hash chain or the sequence numbers of a log do not verify: it was edited after it was written."""


class LogInUseError(LogError):
    """Another open :class:`EventLog` (this process or another) holds the log."""


class LogExistsError(LogError):
    """The path already holds a log and ``resume=True`` was not given."""


def _config(meta: dict[str, Any]) -> bytes:
    """Canonical bytes of the configuration part of the meta table (the chain's genesis covers it)."""
    cfg = {k: v for k, v in meta.items() if k not in (CHAIN_KEY, HEAD_KEY)}
    return json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()


def genesis(log_id: str, meta: dict[str, Any]) -> bytes:
    """``h_0 = SHA-256(tag ‖ log id ‖ canonical configuration)``."""
    return hashlib.sha256(_CHAIN_TAG + log_id.encode() + b"\x00" + _config(meta)).digest()


def chain_hash(prev: bytes, seq: int, row: Row) -> bytes:
    """``h_seq = SHA-256(h_{seq-1} ‖ seq ‖ row)``; every field is length-prefixed and typed (``n`` none, ``s``
    text, ``b`` bytes), so no two different rows hash the same input."""
    parts = [prev, seq.to_bytes(8, "big", signed=True)]
    for x in row:
        if x is None:
            parts.append(b"n")
        else:
            b = x.encode() if isinstance(x, str) else bytes(x)
            parts += (b"s" if isinstance(x, str) else b"b", len(b).to_bytes(8, "big"), b)
    return hashlib.sha256(b"".join(parts)).digest()


def _commit_rows(conn: sqlite3.Connection, lock: threading.Lock, rows: Iterable[ChainedRow]) -> None:
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
    groups: deque[list[ChainedRow]] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    wake: threading.Event = field(default_factory=threading.Event)
    appended: int = 0  # groups queued so far
    committed: int = 0  # groups the writer has taken and committed (or discarded after a failure)
    stop: bool = False
    error: BaseException | None = None

    def put(self, rows: list[ChainedRow]) -> None:
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

    One writer per path: :class:`LogInUseError` while another open log holds ``<path>.lock``;
    :class:`LogExistsError` for an existing log unless ``resume=True`` (then the chain is verified and
    continued; :class:`LogIntegrityError` if it does not verify, :class:`LogError` for a legacy log).
    """

    def __init__(
        self,
        path: str | Path,
        synchronous: str = "NORMAL",
        background: bool = False,
        max_pending: int = 4096,
        max_delay_s: float = 0.2,
        resume: bool = False,
    ) -> None:
        if synchronous not in {"OFF", "NORMAL", "FULL"}:
            raise ValueError(f"synchronous must be OFF, NORMAL or FULL, got {synchronous!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if not max_delay_s > 0:
            raise ValueError(f"max_delay_s must be > 0, got {max_delay_s}")
        self.path = Path(path)
        self.background = background
        self._lock_fd = _acquire(self.path)
        self._release = weakref.finalize(self, os.close, self._lock_fd)  # also if the log is never closed
        try:
            existing = self.path.is_file() and self.path.stat().st_size > 0
            if existing and not resume:
                raise LogExistsError(
                    f"log {str(self.path)!r} already exists; open it with resume=True to continue it "
                    "(request ids carry on) or write to a new path"
                )
            self._seq, self._prev = 0, b""
            if existing:
                reader = LogReader(self.path)
                for _ in reader:  # verifies every row and the configuration
                    pass
                if not reader.chained:
                    raise LogError(f"log {str(self.path)!r} is an unchained legacy log: it cannot be resumed")
                self._seq, self._prev = reader.seq, reader.prev
            self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        except BaseException:
            self._release()
            raise
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._conn.execute(_SCHEMA)
        self._conn.execute(_META)
        self._meta = _meta_rows(self._conn)
        if CHAIN_KEY not in self._meta:
            self._meta[CHAIN_KEY] = {"version": 1, "log_id": os.urandom(16).hex()}
            chain = (CHAIN_KEY, json.dumps(self._meta[CHAIN_KEY]))
            self._conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)", chain)
        if self._meta.pop(HEAD_KEY, None) is not None:  # open again: the head is recorded at the next close
            self._conn.execute("DELETE FROM meta WHERE key = ?", (HEAD_KEY,))
        self._lock = threading.Lock()
        self._chain_lock = threading.Lock()
        self._closed = False
        self._queue: _Queue | None = None
        if background:
            self._queue = _Queue(self._conn, self._lock, max_pending, max_delay_s)
            writer = threading.Thread(target=self._queue.drain, name="kvcert-event-log", daemon=True)
            writer.start()
            self._finalizer = weakref.finalize(self, self._queue.shutdown, writer)

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash hex)`` of the last appended row (``(0, "")`` before any): record it outside the log
        (CI artefact, signed commit) and check it with ``kvcert ledger gate --expect-head``."""
        with self._chain_lock:
            return self._seq, self._prev.hex()

    def set_meta(self, values: dict[str, Any]) -> None:
        """Store configuration (JSON values) the replay needs, e.g. the ledger's ``delta_e``. The chain covers
        the configuration, so once events are logged it is fixed: ``ValueError`` for a different value."""
        with self._chain_lock:
            if self._seq:
                changed = [k for k, v in values.items() if json.loads(json.dumps(v)) != self._meta.get(k)]
                if changed:
                    raise ValueError(
                        f"log {str(self.path)!r} already holds events under another configuration: "
                        + ", ".join(f"{k} {self._meta.get(k)!r} != {values[k]!r}" for k in changed)
                    )
                return
            self._meta.update(json.loads(json.dumps(values)))
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
        with self._chain_lock:  # hashing and queueing in one order
            if self._closed:
                raise ValueError(f"event log {str(self.path)!r} is closed")
            self._raise_writer_error()
            seq = self._seq
            prev = self._prev or genesis(self._meta[CHAIN_KEY]["log_id"], self._meta)
            chained: list[ChainedRow] = []
            for row in rows:
                seq += 1
                prev = chain_hash(prev, seq, row)
                chained.append((seq, *row, prev))
            if self._queue is not None:
                self._queue.put(chained)
            else:
                _commit_rows(self._conn, self._lock, chained)  # the chain advances only if committed
            self._seq, self._prev = seq, prev

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
        """Commit what is queued, record the chain head, stop the writer and close the connection
        (checkpointing the WAL) and release the log's lock."""
        with self._chain_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._queue is not None:
                self._finalizer()  # runs shutdown once: commits the queue, joins the writer
            with self._lock:
                if self._queue is None or self._queue.error is None:
                    head = {"seq": self._seq, "hash": self._prev.hex()}
                    row = (HEAD_KEY, json.dumps(head))
                    self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", row)
                self._conn.close()
        finally:
            self._release()
        self._raise_writer_error()


def _acquire(path: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``<path>.lock`` (released when its descriptor is closed, also
    by a killed process); :class:`LogInUseError` if another open log holds it."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise LogInUseError(
            f"log {str(path)!r} is in use by another ledger ({str(lock)!r} is locked); one writer per log"
        ) from None
    return fd


def _meta_rows(conn: sqlite3.Connection) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in conn.execute("SELECT key, value FROM meta").fetchall():
        try:
            out[str(k)] = json.loads(v)
        except (TypeError, json.JSONDecodeError, RecursionError):
            raise LogError(f"meta value of {k!r} is not JSON") from None
    return out


def _connect(path: str | Path) -> tuple[Path, sqlite3.Connection]:
    p = Path(path)
    if not p.is_file():
        raise LogError(f"log path {str(p)!r} is not a file")
    return p, sqlite3.connect(str(p))  # a writable open lets SQLite roll back a torn WAL tail


class LogReader:
    """Iterate the committed events of a log file in order, verifying as it goes.

    A chained log: sequence numbers must run 1, 2, 3, … and each row's hash must equal
    ``chain_hash(previous hash, seq, row)`` from the genesis over the stored configuration; the first row
    that fails raises :class:`LogIntegrityError` naming its ``seq``. Every row is decoded into a typed,
    checked event (:class:`~kvcert.ledger.events.LogError` naming the ``seq`` otherwise). After a full
    iteration: :attr:`chained`, :attr:`seq` (events read), :attr:`prev` (the head hash) and :attr:`closed`
    (a head was recorded at close and equals the last row: nothing was removed from the end) are set.
    An unchained legacy log is read without verification (``chained`` False).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.chained = False
        self.closed = False
        self.seq = 0
        self.prev = b""
        self.meta: dict[str, Any] = {}

    def _fail(self, seq: int, msg: str, cls: type[LogError] = LogIntegrityError) -> LogError:
        return cls(f"log {str(self.path)!r}: event seq {seq}: {msg}")

    def __iter__(self) -> Iterator[Event]:
        p, conn = _connect(self.path)
        try:
            try:
                self.meta = _meta_rows(conn)
                columns = [r[1] for r in conn.execute("PRAGMA table_info(events)").fetchall()]
                self.chained = "h" in columns
                cols = "seq, kind, meta, a, b, c, d" + (", h" if self.chained else "")
                cursor = conn.execute(f"SELECT {cols} FROM events ORDER BY seq")
            except sqlite3.DatabaseError as exc:
                raise LogError(f"log {str(p)!r} is not a kvcert ledger log: {exc}") from None
            prev = b""
            chain = self.meta.get(CHAIN_KEY)
            if not self.chained and chain is not None:
                raise self._fail(1, "the log was written with a hash chain whose column has been removed")
            if self.chained:
                if not (isinstance(chain, dict) and isinstance(chain.get("log_id"), str)):
                    raise self._fail(1, "chain metadata missing or malformed (the genesis cannot be computed)")
                prev = genesis(chain["log_id"], self.meta)
            expected = 1
            try:
                for raw in cursor:
                    seq, row = raw[0], tuple(raw[1:7])
                    if not isinstance(seq, int) or (self.chained and seq != expected):
                        raise self._fail(
                            expected,
                            f"sequence broken: found seq {seq!r} where {expected} belongs "
                            "(a row was deleted, inserted or moved)",
                        )
                    if self.chained:
                        if chain_hash(prev, seq, row) != raw[7]:
                            what = " or the log's configuration" if seq == 1 else ""
                            raise self._fail(seq, f"hash chain broken: this event{what} was rewritten")
                        prev = raw[7]
                    try:
                        event = decode(row)
                    except LogError as exc:
                        raise self._fail(seq, str(exc), LogError) from None
                    self.seq, self.prev = seq, prev
                    expected += 1
                    yield event
            except sqlite3.DatabaseError as exc:
                raise LogError(f"log {str(p)!r}: unreadable after seq {self.seq}: {exc}") from None
            head = self.meta.get(HEAD_KEY)
            if head is not None:
                if not (isinstance(head, dict) and head.get("seq") == self.seq and head.get("hash") == self.prev.hex()):
                    raise LogIntegrityError(
                        f"log {str(p)!r}: event seq {self.seq + 1}: the head recorded at close ({head!r}) does not "
                        "match "
                        f"the last event (seq {self.seq}): events were removed from the end or the head was edited"
                    )
                self.closed = True
        finally:
            conn.close()

    def describe(self) -> str:
        """One line: what the verification established (call after a full iteration)."""
        if not self.chained:
            return f"unchained legacy log: integrity not verifiable ({self.seq} events)"
        head = f"{self.seq} events, head {self.seq}:{self.prev.hex()}"
        if not self.closed:
            return f"chain verified but the log was not closed (crash or still open): its end is unverified; {head}"
        return f"chain verified and closed: {head}"


def read_events(path: str | Path) -> Iterator[Event]:
    """Iterate the committed events of an existing log file, verifying the chain (:class:`LogReader`)."""
    return iter(LogReader(path))


def read_meta(path: str | Path) -> dict[str, Any]:
    """The configuration stored with :meth:`EventLog.set_meta` (empty if none; without the chain keys)."""
    p, conn = _connect(path)
    try:
        try:
            meta = _meta_rows(conn)
        except sqlite3.DatabaseError as exc:
            raise LogError(f"log {str(p)!r} is not a kvcert ledger log: {exc}") from None
        return {k: v for k, v in meta.items() if k not in (CHAIN_KEY, HEAD_KEY)}
    finally:
        conn.close()
