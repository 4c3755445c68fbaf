"""Strict JSON for evidence files (ledger snapshots, probe snapshots): one clear error, never a traceback.

Python's ``json`` silently keeps the *last* of two equal keys (so ``{"x": 5, "x": 0}`` reads as 0 and can hide
a failing counter) and recurses once per nesting level (a file nested 10^5 deep raises ``RecursionError``).
:func:`loads` refuses both: duplicate keys are an error naming the key, and nesting deeper than
``max_depth`` is measured on the text **before** parsing (linear time, no recursion).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_DEPTH = 64
"""Nesting limit of evidence files (theirs is at most 5)."""

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class StrictJSONError(ValueError):
    """Malformed JSON, a duplicated key, or nesting deeper than the limit."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise StrictJSONError(f"duplicated key {key!r} (a later value would silently replace an earlier one)")
        out[key] = value
    return out


def depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of JSON ``text`` (brackets inside strings do not count)."""
    skeleton = _STRINGS.sub("", text)
    marks = np.frombuffer(skeleton.encode("utf-8", "replace"), dtype=np.uint8)
    step = np.isin(marks, (ord("["), ord("{"))).astype(np.int64) - np.isin(marks, (ord("]"), ord("}")))
    return int(np.cumsum(step).max()) if step.size else 0


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``text`` like ``json.loads`` (``NaN``/``Infinity`` allowed); :class:`StrictJSONError` for
    malformed JSON, a duplicated key in any object, or nesting deeper than ``max_depth``."""
    d = depth(text)
    if d > max_depth:
        raise StrictJSONError(f"nesting depth {d} exceeds the limit of {max_depth}")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise StrictJSONError(f"malformed JSON: {exc}") from None
