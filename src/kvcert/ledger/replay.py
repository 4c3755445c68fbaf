"""Rebuild a ledger from its event log and compare two ledger states field for field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcert.ledger.ledger import Ledger
from kvcert.ledger.log import read_events, read_meta


def replay(path: str | Path) -> Ledger:
    """A fresh :class:`Ledger` (without a log), configured from the log's metadata, with every committed
    event of ``path`` applied in order."""
    meta = read_meta(path)
    missing = {"delta_req", "delta_e", "model", "max_incidents", "rank", "n_ranks"} - meta.keys()
    if missing:
        raise ValueError(f"log {str(path)!r} lacks ledger metadata {sorted(missing)}")
    ledger = Ledger(
        delta_req=meta["delta_req"],
        delta_e=meta["delta_e"],
        model=meta["model"],
        max_incidents=meta["max_incidents"],
        rank=meta["rank"],
        n_ranks=meta["n_ranks"],
    )
    for event in read_events(path):
        ledger.apply(event)
    return ledger


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
