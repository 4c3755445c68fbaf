"""results.json: every number tiered, bad tiers rejected, same document -> same bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvcert.report.results import (
    build_document,
    tiered,
    untiered_numbers,
    without_volatile,
    write_results,
)


def test_tiered_leaf_and_nan() -> None:
    assert tiered(0.5, "certified") == {"value": 0.5, "tier": "certified"}
    assert tiered(math.nan, "empirical") == {"value": None, "tier": "empirical"}
    assert tiered(math.inf, "partial")["value"] is None
    with pytest.raises(ValueError, match="tier"):
        tiered(1.0, "bound")
    with pytest.raises(ValueError, match="value"):
        tiered("1", "empirical")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value"):
        tiered(True, "empirical")


def test_untiered_numbers_finds_every_bare_number() -> None:
    ok = {
        "a": tiered(1, "empirical"),
        "b": [tiered(2.0, "certified"), "text"],
        "c": {"d": tiered(None, "partial")},
    }
    assert untiered_numbers(ok) == []
    bad = {"a": tiered(1, "empirical"), "b": [3.0], "c": {"d": 4}, "e": {"value": 1, "tier": "bogus"}}
    assert untiered_numbers(bad) == ["results.b[0]", "results.c.d", "results.e"]


def test_build_document_refuses_untiered_results() -> None:
    with pytest.raises(ValueError, match="without a tier"):
        build_document("run", {}, {"accuracy": 0.5}, 0, {}, ["kvcert"])


def test_write_is_deterministic_and_volatile_is_separate(tmp_path: Path) -> None:
    res = {"x": tiered(0.25, "empirical")}
    a = build_document("eval", {"seed": 3}, res, 3, {"seconds": 1.0}, ["kvcert", "eval"])
    b = build_document("eval", {"seed": 3}, res, 3, {"seconds": 2.0}, ["kvcert", "eval"])
    pa, pb = write_results(tmp_path / "a.json", a), write_results(tmp_path / "b.json", b)
    assert pa.read_text() != pb.read_text()
    assert without_volatile(json.loads(pa.read_text())) == without_volatile(json.loads(pb.read_text()))
    assert a["reproducibility"]["argv"] == ["kvcert", "eval"] and a["reproducibility"]["seed"] == 3
    write_results(tmp_path / "c.json", a)
    assert (tmp_path / "c.json").read_bytes() == pa.read_bytes()
