"""Fuzz of CLI inputs (issue 21, item 6): malformed results files given to ``kvcert merge`` and random
argument combinations of ``run`` / ``eval`` / ``ppl`` / ``audit``.

Properties, for every generated case: the command either succeeds or ends with exit status 2 and exactly one
line on stderr (no traceback); nothing is ever written outside ``--out``; an argument combination reaches
model loading only when every numeric option is inside its documented range. No model is loaded here:
``load_model`` is replaced by a stub that records the call and stops the command (tiny models only would be
loaded otherwise; SmolLM2 never). Run: ``pytest tests/robustness/test_inputs_fuzz.py``.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvcert.cli import audit, ppl, ruler_command
from kvcert.cli.main import app
from kvcert.eval import ruler

runner = CliRunner()
FUZZ = settings(max_examples=60, deadline=None)


class Loaded(Exception):
    """Raised by the stub loader: the inputs were accepted and the command went on to load the model."""


def _stub_loader(*_args: object, **_kwargs: object) -> None:
    raise Loaded


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _clean_outcome(result: Any) -> None:
    """Exit 0, or exit 2 with one line on stderr; never a traceback or another status."""
    assert "Traceback" not in result.output, result.output
    if result.exit_code != 0:
        assert result.exit_code == 2, (result.exit_code, result.output, repr(result.exception))
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], result.stderr


# ------------------------------------------------------------------------------------- results files
JSON_LEAF = (
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False) | st.text(max_size=8)
)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _tier(v: object) -> dict[str, object]:
    return {"value": v, "tier": "empirical"}


def _valid_shard(task: str) -> dict[str, Any]:
    tel = {
        "cells": _tier(10),
        "coverage_kv@0.2": _tier(0.5),
        "fallback_rate": _tier(0.1),
        "page_in_bytes": _tier(0),
        "max_certificate": _tier(0.3),
        "bytes_per_token_fp16": _tier(100.0),
        "bytes_per_token_stored": _tier(30.0),
    }
    return {
        "command": "eval",
        "config": {"model": "tiny:llama", "context": 512, "schemes": ["int2"], "gate": "off"},
        "results": {
            "variants": {"dense": {"gate": "off", "codecs": None}, "int2": {"gate": "off", "codecs": None, **tel}},
            "per_sample": [
                {"task": task, "index": _tier(i), "scores": {"dense": _tier(1.0), "int2": _tier(0.0)}} for i in range(2)
            ],
        },
    }


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        out += [p for k, v in node.items() for p in _paths(v, (*prefix, k))]
    elif isinstance(node, list):
        out += [p for i, v in enumerate(node) for p in _paths(v, (*prefix, i))]
    return out


@st.composite
def mutated_shard(draw: st.DrawFn) -> str:
    """A valid shard with one node replaced by random JSON or deleted, or random JSON, or random text."""
    kind = draw(st.sampled_from(["replace", "delete", "json", "text"]))
    if kind == "json":
        return json.dumps(draw(JSON))
    if kind == "text":
        return draw(st.text(max_size=64))
    doc = _valid_shard("niah_single_1")
    path = draw(st.sampled_from(_paths(doc)[1:]))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JSON)
    return json.dumps(doc)


@FUZZ
@given(content=mutated_shard())
def test_merge_of_malformed_results_is_clean_and_writes_only_to_out(content: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, text in (("bad", content), ("good", json.dumps(_valid_shard("niah_single_2")))):
            (root / name).mkdir()
            (root / name / "results.json").write_text(text)
        before = _files(root)
        result = runner.invoke(
            app, ["merge", str(root / "bad"), str(root / "good"), "--out", str(root / "out"), "--resamples", "20"]
        )
        _clean_outcome(result)
        event("merged" if result.exit_code == 0 else "refused")
        after = {k: v for k, v in _files(root).items() if not k.startswith("out/")}
        assert after == before  # inputs untouched, nothing written beside --out
        if result.exit_code != 0:
            assert not (root / "out").exists()


# ------------------------------------------------------------------------------------------ arguments
INTS = st.sampled_from([-1, 0, 1, 2, 3, 511, 512, 4096, 4097, 10**9])
GATES = st.sampled_from(
    [
        "auto",
        "off",
        "certified:0",
        "certified:0.2",
        "certified:1",
        "certified:5",
        "certified:inf",
        "certified:1e400",
        "certified:nan",
        "certified:-1",
        "risk:5",
        "risk:inf",
        "risk:",
        "x:1",
        "",
    ]
)
MODELS = st.sampled_from(["tiny:llama", "tiny:gemma3", "tiny:gpt2", "tiny:", "no-such-model", "/no/such/dir"])
SCHEMES = st.sampled_from(["int4", "int4,kivi-2", "int4/int2", "bogus", "int4,int4", "", "a/b/c"])
TASKS = st.sampled_from(["niah_single_1", "niah_single_1,vt", "qa_1", "nope", "", "niah_single_1,niah_single_1"])


@st.composite
def command_line(draw: st.DrawFn) -> tuple[list[str], dict[str, Any]]:
    command = draw(st.sampled_from(["run", "eval", "ppl", "audit"]))
    values = {"context": draw(INTS), "model": draw(MODELS)}
    args = [command, "--model", values["model"], "--context", str(values["context"])]
    if command in ("run", "eval", "ppl"):
        values["schemes"] = draw(SCHEMES)
        args += ["--schemes", values["schemes"]]
    if command in ("run", "eval"):
        values["samples"] = draw(INTS)
        values["max_new_tokens"] = draw(INTS)
        values["tasks"] = draw(TASKS)
        args += ["--samples", str(values["samples"]), "--max-new-tokens", str(values["max_new_tokens"])]
        args += ["--tasks", values["tasks"]] if command == "run" else ["--task", "ruler:" + values["tasks"]]
    if command in ("eval", "ppl"):
        values["gate"] = draw(GATES)
        args += ["--gate", values["gate"]]
    if command == "ppl":
        values["windows"], values["chunk"] = draw(INTS), draw(INTS)
        args += ["--windows", str(values["windows"]), "--chunk", str(values["chunk"])]
    if command == "audit":
        values["max_new_tokens"] = draw(INTS)
        values["tasks"] = draw(TASKS)
        args += ["--keys", draw(SCHEMES), "--max-new-tokens", str(values["max_new_tokens"]), "--task", values["tasks"]]
    return args, values


def _gate_ok(text: str) -> bool:
    kind, _, value = text.partition(":")
    if text in ("auto", "off"):
        return True
    try:
        ok = kind in ("certified", "risk") and math.isfinite(float(value)) and float(value) >= 0
        return ok and (kind == "risk" or float(value) <= 1)  # a certified tau bounds a TV: at most 1
    except ValueError:
        return False


@FUZZ
@given(case=command_line())
def test_argument_combinations_are_refused_cleanly_or_in_range(case: tuple[list[str], dict[str, Any]]) -> None:
    args, values = case
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        for module in (ruler_command, ppl, audit):
            mp.setattr(module, "load_model", _stub_loader)
        root = Path(tmp)
        result = runner.invoke(app, [*args, "--out", str(root / "out")])
        assert [p for p in root.iterdir() if p.name != "out"] == []
        event("accepted" if isinstance(result.exception, Loaded) else "refused")
        if isinstance(result.exception, Loaded):  # accepted: every documented range holds
            assert values["model"] in ("tiny:llama", "tiny:gemma3")
            assert 1 <= values["context"] <= 4096
            assert values.get("samples", 1) >= 1 and values.get("max_new_tokens", 1) >= 1
            assert values.get("windows", 1) >= 1 and values.get("chunk", 1) >= 1
            assert _gate_ok(values.get("gate", "auto"))
            tasks = [t for t in values.get("tasks", "").split(",") if t]
            assert all(values["context"] >= ruler.MIN_CONTEXT[t] for t in tasks)
            assert list(root.joinpath("out").iterdir()) == []  # checked and created, nothing written yet
        else:
            _clean_outcome(result)
            assert result.exit_code == 2 and not (root / "out").exists()
