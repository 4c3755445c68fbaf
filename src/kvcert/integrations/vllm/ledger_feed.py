"""The request ledger of a vLLM worker process: one account and one cache observer per vLLM request id.

Pure Python + kvcert (no vLLM import). :class:`ServingLedger` owns a :class:`~kvcert.ledger.Ledger` whose event
log (``DIR/ledger.db``) is written with **group commits** (``EventLog(background=True)``: the serving path only
encodes and queues each event; a writer thread commits what is queued in one transaction at least every 0.2 s).
The runtime (:mod:`kvcert.integrations.vllm.runtime`) feeds it the same cache events the transformers
``CertifiedCache`` feeds its observers, built by the same functions
(:func:`kvcert.cache.events.last_write_event`, :func:`kvcert.attention.read_path.read_event`), through a
:class:`~kvcert.ledger.LedgerObserver` per request.

**Pools and lanes.** The ledger's slot tables are keyed by ``(pool, layer)`` and are never dropped (they are part
of the state the log replays), so a pool per request id would grow them without bound. Each live request is
given a *lane*: the pool ``vllm/<lane>``, taken from a free list and returned when vLLM reports the request
finished. A later request on the same lane rewrites the slots it uses (invalidate-at-write: the generation is
bumped and it becomes the owner), exactly the slot-reuse case the ledger is built for; reads cover only slots the
reading request wrote. The number of lanes is the largest number of requests live at once. Per-request state
(observer, lane) is released on finish; the request's **account** stays in the ledger (it is the record the
gate checks, a few hundred bytes).

**Summary.** A daemon thread writes :meth:`Ledger.summary` to ``DIR/summary.json`` and to a callback (the
records file, read by the API server's ``/metrics``) at most every ``interval_s`` while the ledger changes.
:meth:`ServingLedger.close` (run at process exit: ``atexit`` and multiprocessing's exit finalizers, which vLLM's
worker process runs when it exits gracefully — ``kvcert serve`` passes ``--shutdown-timeout``) writes the last
summary, ``DIR/ledger.json`` (the snapshot ``kvcert ledger gate DIR`` checks against the log) and closes the log
(recording its hash-chain head).
"""

from __future__ import annotations

import atexit
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util
from pathlib import Path
from typing import Any

from kvcert.ledger.ledger import Ledger
from kvcert.ledger.log import EventLog
from kvcert.ledger.observer import LedgerObserver

#: ledger files inside the ``--ledger`` directory
LOG_NAME = "ledger.db"
SNAPSHOT_NAME = "ledger.json"
SUMMARY_NAME = "summary.json"
#: the pool family of the plugin's lanes
POOL = "vllm"


@dataclass
class Lease:
    """A live request's place in the ledger: its account UID, its lane and the observer of its cache events."""

    uid: int
    lane: int
    observer: LedgerObserver

    @property
    def pool(self) -> str:
        """The lane's pool name."""
        return self.observer.pool


class ServingLedger:
    """The ledger of one serving process (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        model: str = "vllm",
        delta_req: float = 0.01,
        publish: Callable[[dict[str, Any]], None] | None = None,
        interval_s: float = 0.5,
        register_exit: bool = True,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.dir / LOG_NAME, background=True)
        self.ledger = Ledger(delta_req, log=self.log, model=model)
        self.leases: dict[str, Lease] = {}
        self._free: list[int] = []
        self._lanes = 0
        self._publish = publish
        self._interval = interval_s
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._publisher, name="kvcert-ledger-summary", daemon=True)
        self._thread.start()
        if register_exit:
            atexit.register(self.close)
            util.Finalize(None, self.close, exitpriority=50)  # vLLM's engine process exits through these

    # ------------------------------------------------------------------------------------------ requests
    def lease(self, request_id: str, uid: int | None = None) -> Lease:
        """The request's lease: its open one, else a new one (a fresh account unless ``uid`` re-leases a
        restarted request's account) on a free lane, with a fresh observer."""
        held = self.leases.get(request_id)
        if held is not None and uid is None:
            return held
        if held is not None:
            lane = held.lane
        else:
            lane = self._free.pop() if self._free else self._new_lane()
        account = self.ledger.open_request() if uid is None else uid
        lease = Lease(account, lane, LedgerObserver(self.ledger, pool=f"{POOL}/{lane}"))
        self.leases[request_id] = lease
        return lease

    def _new_lane(self) -> int:
        self._lanes += 1
        return self._lanes - 1

    def release(self, request_id: str) -> None:
        """Forget a finished request's lease (its lane is free again; its account stays in the ledger)."""
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self._free.append(lease.lane)
        self.touch()

    def account(self, uid: int) -> dict[str, Any]:
        """What the ledger holds for account ``uid``: δ spent and the read counters (for the request's record)."""
        with self.ledger._lock:
            a = self.ledger.accounts.get(uid)
            if a is None:
                return {}
            return {"delta_spent": a.budget.spent_upper, **a.counts}

    @property
    def lanes(self) -> int:
        """Lanes ever created (the largest number of requests live at once)."""
        return self._lanes

    # ------------------------------------------------------------------------------------------- summary
    def touch(self) -> None:
        """Say the ledger changed (the publisher thread writes the summary within ``interval_s``)."""
        self._changed.set()

    def summary(self) -> dict[str, Any]:
        """:meth:`Ledger.summary` plus the lanes."""
        s = self.ledger.summary()
        s["lanes"] = self._lanes
        s["live_requests"] = len(self.leases)
        return s

    def _publisher(self) -> None:
        while not self._stop.is_set():
            if self._changed.wait(self._interval) and not self._stop.is_set():
                self._changed.clear()
                self._publish_now()
                self._stop.wait(self._interval)

    def _publish_now(self) -> None:
        """Publish the summary and rewrite ``summary.json`` (atomically: a killed process leaves the last one)."""
        summary = self.summary()
        try:
            if self._publish is not None:
                self._publish(summary)
            tmp = self.dir / (SUMMARY_NAME + ".tmp")
            tmp.write_text(json.dumps(summary, indent=1))
            tmp.replace(self.dir / SUMMARY_NAME)
        except Exception:  # noqa: BLE001 (a metrics write must never stop serving)
            pass

    def close(self) -> None:
        """Write the last summary, ``ledger.json`` and ``summary.json``, close the log (idempotent)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._changed.set()
        self._thread.join(5)
        self._publish_now()
        self.ledger.save(self.dir / SNAPSHOT_NAME)
        self.log.close()
