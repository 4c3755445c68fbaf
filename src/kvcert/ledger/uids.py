"""Request identity: monotone UIDs that are never reused (``docs/ledger.md#slots-and-identity``)."""

from __future__ import annotations

import threading

UNATTRIBUTED = -1
"""Owner/reader value of an entry whose request could not be established (fail closed)."""


class UidAllocator:
    """Thread-safe allocator of strictly increasing request UIDs ``start, start+1, …``; never reused."""

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self._next = start
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """Return a UID larger than every UID returned before (by any thread)."""
        with self._lock:
            uid = self._next
            self._next += 1
            return uid

    def advance_past(self, uid: int) -> None:
        """Make every future UID exceed ``uid`` (used after replay so restored UIDs are never reissued)."""
        with self._lock:
            self._next = max(self._next, uid + 1)

    @property
    def next_uid(self) -> int:
        """The UID the next :meth:`allocate` call returns."""
        return self._next
