"""Rebuild a ledger from its event log and compare two ledger states field for field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcert.ledger.events import LogError
from kvcert.ledger.ledger import Ledger
from kvcert.ledger.log import LogReader, read_meta

_CONFIG = {"delta_req": float, "delta_e": float, "model": str, "max_incidents": int, "rank": int, "n_ranks": int}


def replay(path: str | Path) -> Ledger:
    """A fresh :class:`Ledger` (without a log), configured from the log's metadata, with every committed
    event of ``path`` verified (:class:`~kvcert.ledger.log.LogReader`), checked
    (:meth:`Ledger.check_event`) and applied in order; :class:`~kvcert.ledger.events.LogError` (one line,
    naming the first bad ``seq``) otherwise."""
    return replay_verified(path)[0]


def replay_verified(path: str | Path) -> tuple[Ledger, LogReader]:
    """:func:`replay`, also returning the exhausted :class:`LogReader` (chained? closed? head?)."""
    meta = read_meta(path)
    missing = _CONFIG.keys() - meta.keys()
    if missing:
        raise LogError(f"log {str(path)!r} lacks ledger metadata {sorted(missing)}")
    for key, kind in _CONFIG.items():
        value = meta[key]
        if isinstance(value, bool) or not (isinstance(value, kind) or (kind is float and isinstance(value, int))):
            raise LogError(f"log {str(path)!r}: metadata {key} must be {kind.__name__}, got {value!r}")
    try:
        ledger = Ledger(**{k: meta[k] for k in _CONFIG})
    except ValueError as exc:
        raise LogError(f"log {str(path)!r}: metadata: {exc}") from None
    reader = LogReader(path)
    for event in reader:
        try:
            ledger.apply(event)
        except ValueError as exc:
            raise LogError(f"log {str(path)!r}: event seq {reader.seq}: {exc}") from None
    return ledger, reader


def diff_states(a: Any, b: Any, path: str = "$") -> list[str]:
    """Every field where two snapshots (:meth:`Ledger.snapshot`, JSON data) differ; empty if identical."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: missing on the right" for k in a if k not in b]
        out += [f"{path}.{k}: missing on the left" for k in b if k not in a]
        for k in a:
            if k in b:
                out += diff_states(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += diff_states(x, y, f"{path}[{i}]")
        return out
    if type(a) is not type(b) or a != b:
        if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # both NaN
            return []
        return [f"{path}: {a!r} != {b!r}"]
    return []
