"""Per-request certificate records of the vLLM plugin and the SQLite file that carries them across processes.

vLLM runs the model in an engine process and answers HTTP in another; the plugin's worker side accumulates one
:class:`RequestRecord` per request id and writes it (one upsert per engine step, :class:`RecordStore`) so the
API server side can attach it to the response and export it as metrics. Pure Python (no vLLM import).

Tiers of the fields: ``max_certificate``, ``max_certificate_pre`` and ``cells_over_tau`` are **certified**
(each is a maximum / count over per-cell Tier-A certificates, sound upper bounds on the total-variation
distance between served and exact attention); ``repaired_reads``, ``bytes_paged``, ``exact_reads`` and
``prefill_tokens`` are exact counts of what the plugin did; ``coverage`` is an **empirical** share of this
request's traffic; ``violations`` / ``out_violations`` / ``max_true_tv`` exist only in validate mode (measured
against exact attention recomputed from the host tier: cells whose true TV exceeded the certificate, or whose true
output error exceeded the output bound). ``ledger_*`` exist when the request ledger is on
(:mod:`kvcert.integrations.vllm.ledger_feed`): the request's account UID and lane pool, the δ its account
spent (certified: an upper bound on the failure budget used) and its located read incidents (unwritten, stale or
foreign-owner slot reads; 0 expected). ``device_bytes`` / ``fp16_bytes`` / ``host_bytes`` are measured from
kvcert's stores after each step of the request (:meth:`~kvcert.cache.store.LayerStore.bytes_device` etc., summed over
layers): kvcert's compressed tier (its packed codes live in vLLM's own KV blocks), what an fp16 cache would hold,
and the exact host tier.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path

#: key of the ledger summary in the records file's ``meta`` table (read by the API server's ``/metrics``)
LEDGER_SUMMARY = "ledger_summary"


@dataclass
class RequestRecord:
    """What the certified read path did for one request (all decode reads, every layer).

    ``reads`` counts (layer, KV head, decode step) reads that went through the certified path; ``cells`` the
    (layer, query head, decode step) cells certified; ``repaired_reads`` the KV-head reads the gate repaired from
    the host tier (the whole head, or some of its token blocks under a ``:block`` gate); ``repaired_blocks`` the
    token blocks block repairs paged in; ``value_repaired_reads`` the KV-head reads the value gate (``:values=NU``)
    served exact values from the host tier; ``exact_reads`` the per-layer decode reads that saw no compressed entry
    yet (all entries still pending/exact: served exact over the host tier, certificate 0); ``prefill_tokens`` the
    prompt tokens, served exact over the host tier.
    """

    request_id: str
    tau: float | None = None
    decode_steps: int = 0
    prefill_tokens: int = 0
    reads: int = 0
    cells: int = 0
    repaired_reads: int = 0
    repaired_blocks: int = 0
    value_repaired_reads: int = 0
    exact_reads: int = 0
    cells_over_tau: int = 0
    max_certificate: float = 0.0
    max_certificate_pre: float = 0.0
    bytes_paged: int = 0
    validated_cells: int = 0
    violations: int = 0
    out_violations: int = 0
    max_true_tv: float = 0.0
    device_bytes: int = 0
    fp16_bytes: int = 0
    host_bytes: int = 0
    ledger_uid: int | None = None
    ledger_pool: str | None = None
    ledger_delta_spent: float = 0.0
    ledger_incidents: int = 0
    finished: bool = False

    @property
    def coverage(self) -> float:
        """Share of certified KV-head reads served from the compressed tier without repair (empirical)."""
        return 1.0 - self.repaired_reads / self.reads if self.reads else 1.0

    @property
    def fallback_share(self) -> float:
        """Share of certified KV-head reads repaired exactly from the host tier."""
        return self.repaired_reads / self.reads if self.reads else 0.0

    def summary(self) -> dict[str, object]:
        """The response field: every counter plus coverage and fallback share, with their tiers."""
        out: dict[str, object] = asdict(self)
        out["coverage"] = self.coverage
        out["fallback_share"] = self.fallback_share
        out["tiers"] = {
            "max_certificate": "certified",
            "max_certificate_pre": "certified",
            "cells_over_tau": "certified",
            "coverage": "empirical",
            "fallback_share": "empirical",
            "violations": "measured (validate mode)",
            "out_violations": "measured (validate mode)",
            "ledger_delta_spent": "certified",
            "ledger_incidents": "exact",
        }
        return out

    @classmethod
    def from_json(cls, text: str) -> RequestRecord:
        """Inverse of ``json.dumps(asdict(record))``."""
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class RecordStore:
    """A SQLite table ``records(request_id PRIMARY KEY, body JSON)`` shared by the engine and the API server.

    Writers upsert (:meth:`put`); readers look records up by request id or by id prefix (the API server knows
    the OpenAI id, the engine may append a per-choice suffix). WAL mode lets both processes work at once.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("CREATE TABLE IF NOT EXISTS records (request_id TEXT PRIMARY KEY, body TEXT NOT NULL)")
        self._conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, body TEXT NOT NULL)")

    def put(self, records: list[RequestRecord]) -> None:
        """Insert or replace ``records`` in one transaction."""
        if not records:
            return
        rows = [(r.request_id, json.dumps(asdict(r))) for r in records]
        with self._lock:
            self._conn.execute("BEGIN")
            self._conn.executemany("INSERT OR REPLACE INTO records VALUES (?, ?)", rows)
            self._conn.execute("COMMIT")

    def matching(self, request_id: str) -> list[RequestRecord]:
        """Records whose id equals ``request_id`` or starts with ``request_id + '-'`` (per-choice suffixes)."""
        pattern = request_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "-%"
        with self._lock:
            rows = self._conn.execute(
                "SELECT body FROM records WHERE request_id = ? OR request_id LIKE ? ESCAPE '\\'",
                (request_id, pattern),
            ).fetchall()
        return [RequestRecord.from_json(body) for (body,) in rows]

    def put_meta(self, key: str, value: object) -> None:
        """Store a JSON value under ``key`` (e.g. the engine's ledger summary)."""
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str) -> object | None:
        """The JSON value stored under ``key`` (``None`` if absent)."""
        with self._lock:
            row = self._conn.execute("SELECT body FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def all(self) -> list[RequestRecord]:
        """Every record."""
        with self._lock:
            rows = self._conn.execute("SELECT body FROM records").fetchall()
        return [RequestRecord.from_json(body) for (body,) in rows]


def merge(records: list[RequestRecord], request_id: str) -> RequestRecord:
    """One record for a response made of several engine requests (e.g. ``n > 1`` choices): counts add up,
    maxima (and each account's δ spent) take the maximum; the ledger UID and pool are kept only for one record."""
    out = RequestRecord(request_id, tau=records[0].tau if records else None)
    if len(records) == 1:
        out.ledger_uid, out.ledger_pool = records[0].ledger_uid, records[0].ledger_pool
    for r in records:
        for f in fields(RequestRecord):
            if f.name in ("request_id", "tau", "ledger_uid", "ledger_pool"):
                continue
            a, b = getattr(out, f.name), getattr(r, f.name)
            if f.name.startswith("max_") or f.name == "ledger_delta_spent":
                setattr(out, f.name, max(a, b))
            elif f.name == "finished":
                setattr(out, f.name, a or b)
            else:
                setattr(out, f.name, a + b)
    out.finished = all(r.finished for r in records) if records else False
    return out
