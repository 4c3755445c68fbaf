"""``--resident`` / ``--select`` of ``kvcert eval``, the resident variant of ``kvcert run``, and merging them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from kvcert.cli.common import SELECT_POLICIES
from kvcert.cli.main import app
from kvcert.cli.merge import merge_results
from kvcert.cli.ruler_report import context_ratios, resident_numbers, resident_reads_above
from kvcert.eval.branching import Scheme, run_branches
from kvcert.models.tiny import tiny_random
from kvcert.report.results import untiered_numbers

runner = CliRunner()
TINY = [
    "--model",
    "tiny:llama",
    "--seed",
    "0",
    "--context",
    "512",
    "--samples",
    "1",
    "--max-new-tokens",
    "3",
    "--task",
    "ruler:niah_single_1",
    "--schemes",
    "int4",
    "--resamples",
    "100",
]
RESIDENT_FIELDS = {
    "resident_fraction": "empirical",
    "max_omitted_mass_bound": "certified",
    "pages_recalled": "empirical",
    "bytes_recalled": "empirical",
    "bytes_summary": "empirical",
    "recall_ratio": "empirical",
    "bytes_fp16_context": "empirical",
    "bytes_device_sliding": "empirical",
    "capacity_context": "empirical",
    "resident_reads": "empirical",
    "reads_mass_bound_above": "certified",
}
RECALL_NEED = ("resident_reads", "reads_mass_bound_above", "reads_mass_above")


def _eval_resident(out: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``kvcert eval`` on the tiny model with ``args``, writing to ``out``; assert it exited 0 and return its
    results.json and the resident variant's numbers in it."""
    result = runner.invoke(app, ["eval", *TINY, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    return doc, doc["results"]["variants"]["int4+resident"]


# Refused resident options and the message each gets; kvcert frontier refuses them with the same messages.
BAD_RESIDENT: list[tuple[list[str], str]] = [
    (["--resident", "0"], "--resident must be a fraction in (0, 1]"),
    (["--resident", "1.5"], "--resident must be a fraction in (0, 1]"),
    (["--resident", "nan"], "--resident must be a fraction in (0, 1]"),
    (["--resident", "0.25", "--select", "belady"], "--select: unknown policy 'belady'"),
    (["--select", "snapkv"], "--select picks the resident set"),
    (["--resident", "0.25", "--gate", "risk:5"], "--resident needs --gate auto, off or certified:TAU"),
    (["--resident", "0.05"], "fewer than the 32 that --select snapkv protects"),  # 26 of 512 tokens kept
    (["--reselect", "4"], "--reselect re-selects the resident set"),
    (["--resident", "0.25", "--reselect", "0"], "--reselect must be a positive number"),
    (["--resident", "0.25", "--reselect", "2", "--schemes", "dither-int8/int4"], "dithered codecs"),
    (["--recall", "swap"], "--recall chooses how a resident set recalls"),
    (["--resident", "0.25", "--recall", "lazy"], "--recall: unknown recall form 'lazy'"),
    (["--resident", "0.25", "--recall", "swap", "--schemes", "dither-int8/int4"], "--recall swap cannot re-encode"),
    (["--summary", "basis8"], "--summary summarises a resident set's omitted keys"),
    (["--resident", "0.25", "--summary", "pca"], "--summary: unknown summary 'pca'"),
    (["--resident-alloc", "mass"], "--resident-alloc splits the resident set"),
    (["--resident", "0.25", "--resident-alloc", "greedy"], "--resident-alloc: unknown split 'greedy'"),
    (
        ["--resident", "0.25", "--select", "streaming", "--resident-alloc", "mass"],
        "--resident-alloc mass splits by attention scores",
    ),
]


@pytest.mark.parametrize(("args", "needle"), BAD_RESIDENT)
def test_bad_resident_options_are_refused_before_loading(tmp_path: Path, args: list[str], needle: str) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["eval", *TINY, *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcert eval: error:") and needle in lines[0], result.output
    assert not out.exists() and "loading model" not in result.output


def test_eval_resident_variant_reports_tiered_numbers(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    result = runner.invoke(
        app,
        ["eval", *TINY, "--gate", "certified:0.2", "--resident", "0.25", "--select", "streaming", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "Resident variants" in result.output
    row = next(line for line in result.output.splitlines() if line.startswith("| int4+resident | certified"))
    doc = json.loads((out / "results.json").read_text())
    assert untiered_numbers(doc["results"]) == []
    assert (doc["config"]["resident"], doc["config"]["select"]) == (0.25, "streaming")
    variants = doc["results"]["variants"]
    assert list(variants) == ["dense", "int4", "int4+gate", "int4+resident"]
    kept = variants["int4+resident"]
    assert kept["gate"] == "certified(tau=0.2, head)" and kept["select"] == "streaming"
    assert {k: kept[k]["tier"] for k in RESIDENT_FIELDS} == RESIDENT_FIELDS
    assert 0.2 < kept["resident_fraction"]["value"] < 0.35  # 25 % of the prompt, plus decoded tokens
    assert 0.0 <= kept["max_omitted_mass_bound"]["value"] <= 1.0
    context = kept["bytes_fp16_context"]["value"]  # every written token; bytes_fp16 counts the resident ones
    assert kept["bytes_fp16"]["value"] == pytest.approx(kept["resident_fraction"]["value"] * context)
    assert kept["recall_ratio"]["value"] == pytest.approx(kept["bytes_recalled"]["value"] / context)
    assert kept["capacity_context"]["value"] == pytest.approx(context / kept["bytes_device"]["value"])
    assert context == variants["int4"]["bytes_fp16"]["value"]  # the plain scheme holds every token
    assert kept["bytes_device_sliding"]["value"] == 0  # no sliding-window layer: no ceiling
    # the summary table's capacity column shows the context capacity for the resident row, not the resident-only one
    assert f"| {kept['capacity_context']['value']:.3g} |" in row
    assert "omitted_mass" not in json.dumps(variants["int4+gate"])  # only resident variants carry them
    html = (out / "report.html").read_text()
    assert "Resident variants" in html and "R = 0.25 chosen by streaming" in html


@pytest.mark.parametrize("select", sorted(SELECT_POLICIES))
def test_every_select_policy_in_validate_mode(select: str) -> None:
    """Each CLI policy name builds a resident cache; validate mode adds the exact omitted mass (never above the
    largest bound) and 0 recall violations."""
    model = tiny_random("llama", seed=0, head_dim=64)
    ids = torch.randint(0, model.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))
    scheme = Scheme("int8+resident", "int8", "int8", validate=True, resident=0.25, select=SELECT_POLICIES[select])
    (res,) = run_branches(model, ids, [scheme], max_new_tokens=2, eos_ids=[])
    assert res.telemetry is not None
    numbers = resident_numbers([res.telemetry])
    assert numbers["recall_violations"] == {"value": 0, "tier": "empirical"}
    assert 0.0 <= numbers["max_omitted_mass"]["value"] <= numbers["max_omitted_mass_bound"]["value"] <= 1.0
    # a sound bound is above tau wherever the exact mass is: never fewer reads above it
    reads, bound_above, above = (numbers[k]["value"] for k in RECALL_NEED)
    assert 0 <= above <= bound_above <= reads and reads > 0


def testresident_reads_above_counts_kv_heads_by_their_worst_query_head() -> None:
    """A KV-head read counts when any query head of its group exceeds tau; reads with no resident read (NaN) and the
    prefill step's NaN rows are skipped; the count is exact (ties at tau are not above)."""
    nan = float("nan")
    bound = torch.tensor([[[[0.1, 0.3, 0.0, 0.2]]], [[[nan, nan, 0.05, 0.9]]]])  # [steps 2, layers 1, B 1, Hq 4]
    tel = SimpleNamespace(omitted_mass_bound=bound, group_size=2)
    assert resident_reads_above([tel], "omitted_mass_bound", 0.2) == (3, 2)  # (0.1,0.3) (0.0,0.2) | (nan) (0.05,0.9)
    assert resident_reads_above([tel, tel], "omitted_mass_bound", 0.95) == (6, 0)
    assert resident_reads_above(
        [SimpleNamespace(omitted_mass_bound=None, group_size=2)], "omitted_mass_bound", 0.2
    ) == (0, 0)


def _t(v: float | int | None, tier: str = "empirical") -> dict:
    return {"value": v, "tier": tier}


def _shard(task: str, n: int, fraction: float, pages: int, recalled: int, bound: float, select: str = "snapkv") -> dict:
    per_sample = [
        {"task": task, "index": _t(i), "scores": {"dense": _t(1.0), "int8+resident": _t(1.0)}} for i in range(n)
    ]
    tel = {
        "cells": _t(10 * n),
        "page_in_bytes": _t(0),
        "fail_closed": _t(0),
        "max_certificate": _t(bound, "certified"),
        "bytes_fp16": _t(250 * n),
        "bytes_fp16_context": _t(1000 * n),
        "bytes_device": _t(400 * n),
        "bytes_per_token_fp16": _t(100.0),
        "bytes_per_token_stored": _t(50.0),
        "resident_fraction": _t(fraction),
        "max_omitted_mass_bound": _t(bound, "certified"),
        "pages_recalled": _t(pages),
        "bytes_recalled": _t(recalled),
        "bytes_summary": _t(7),
        "recall_ratio": _t(recalled / (1000 * n)),
        "resident_reads": _t(10 * n),
        "reads_mass_bound_above": _t(2 * n, "certified"),
    }
    return {
        "command": "eval",
        "config": {"model": "m", "resident": 0.25, "select": select},
        "results": {
            "variants": {
                "dense": {"gate": "off", "codecs": None},
                "int8+resident": {
                    "gate": "certified(tau=0.2, head)",
                    "select": select,
                    "codecs": {"keys": "int8"},
                    **tel,
                },
            },
            "per_sample": per_sample,
        },
    }


def test_merge_pools_resident_numbers() -> None:
    a = _shard("t1", 1, 0.3, pages=4, recalled=400, bound=0.5)
    b = _shard("t2", 3, 0.26, pages=6, recalled=200, bound=0.9)
    a["results"]["variants"]["int8+resident"]["page_in_bytes"] = _t(80)
    b["results"]["variants"]["int8+resident"]["page_in_bytes"] = _t(120)
    merged = merge_results([a, b], [Path("a"), Path("b")], seed=0, resamples=100)
    assert untiered_numbers(merged) == []
    v = merged["variants"]["int8+resident"]
    assert v["resident_reads"] == _t(40) and v["reads_mass_bound_above"] == _t(8, "certified")
    assert v["select"] == "snapkv"
    assert v["pages_recalled"]["value"] == 10 and v["bytes_recalled"]["value"] == 600
    assert v["bytes_summary"]["value"] == 14
    assert v["max_omitted_mass_bound"] == _t(0.9, "certified")
    assert v["resident_fraction"]["value"] == pytest.approx((0.3 + 3 * 0.26) / 4)
    assert v["recall_ratio"]["value"] == pytest.approx(600 / 4000)
    assert v["bytes_fp16_context"]["value"] == 4000 and v["capacity_context"]["value"] == pytest.approx(4000 / 1600)
    assert v["page_in_ratio_context"] == _t(pytest.approx(200 / 4000))
    assert v["bytes_per_token_device_context"] == _t(pytest.approx(100.0 * 1600 / 4000))  # fp16 B/token / capacity
    assert "bytes_recall_floor" not in v and "recall_floor_ratio" not in v  # not validated


def test_merge_sums_the_recall_floor_of_validated_shards() -> None:
    a = _shard("t1", 1, 0.3, pages=4, recalled=400, bound=0.5)
    b = _shard("t2", 3, 0.26, pages=6, recalled=200, bound=0.9)
    a["results"]["variants"]["int8+resident"]["bytes_recall_floor"] = _t(30)
    b["results"]["variants"]["int8+resident"]["bytes_recall_floor"] = _t(50)
    v = merge_results([a, b], [Path("a"), Path("b")], seed=0, resamples=100)["variants"]["int8+resident"]
    assert v["bytes_recall_floor"] == _t(80)
    assert v["recall_floor_ratio"] == _t(pytest.approx(80 / 4000))


def test_context_ratios_are_nan_without_a_denominator_or_numerator() -> None:
    got = context_ratios(0, 0, None, None, 100.0)
    assert set(got) == {"capacity_context", "bytes_per_token_device_context", "page_in_ratio_context", "recall_ratio"}
    assert all(v == _t(None) for v in got.values())  # NaN is stored as null
    assert context_ratios(1000, 250, 50, 20, 100.0) == {
        "capacity_context": _t(4.0),
        "bytes_per_token_device_context": _t(25.0),
        "page_in_ratio_context": _t(0.05),
        "recall_ratio": _t(0.02),
    }


def test_merge_refuses_a_summed_count_with_two_tiers() -> None:
    a = _shard("t1", 1, 0.3, pages=4, recalled=400, bound=0.5)
    b = _shard("t2", 1, 0.3, pages=4, recalled=400, bound=0.5)
    b["results"]["variants"]["int8+resident"]["reads_mass_bound_above"]["tier"] = "empirical"
    with pytest.raises(ValueError, match="reads_mass_bound_above has the tiers"):
        merge_results([a, b], [Path("a"), Path("b")], seed=0, resamples=100)


@pytest.mark.parametrize(("key", "other"), [("select", "h2o"), ("resident", 0.5)])
def test_merge_refuses_shards_with_other_resident_options(key: str, other: object) -> None:
    a = _shard("t1", 1, 0.3, pages=4, recalled=400, bound=0.5)
    b = _shard("t2", 1, 0.3, pages=4, recalled=400, bound=0.5)
    b["config"][key] = other
    with pytest.raises(ValueError, match=f"{key} {other!r} differs"):
        merge_results([a, b], [Path("a"), Path("b")], seed=0, resamples=100)


def test_eval_resident_validate_reports_exact_omitted_mass_and_zero_violations(tmp_path: Path) -> None:
    """``kvcert eval --resident R --select P --validate``: the resident variant carries the exact omitted mass (never
    above the largest bound), 0 recall violations and 0 certificate violations; page-in (recall + exact resident
    reads + dense fallback) is at least the recalled bytes, both against the whole context."""
    args = ["--gate", "certified:0.2", "--resident", "0.25", "--select", "streaming", "--validate"]
    doc, kept = _eval_resident(tmp_path / "eval", *args)
    assert doc["config"]["validate"] is True
    assert kept["recall_violations"] == {"value": 0, "tier": "empirical"}
    assert kept["violations"]["value"] == 0
    assert 0.0 <= kept["max_omitted_mass"]["value"] <= kept["max_omitted_mass_bound"]["value"] <= 1.0
    assert kept["page_in_bytes"]["value"] >= kept["bytes_recalled"]["value"]
    assert 0 < kept["bytes_recalled_keys"]["value"] <= kept["bytes_recalled"]["value"]  # key-first: keys, some values
    # the recall floor: what no sound bound could have saved, never above what was paged in
    assert 0 <= kept["bytes_recall_floor"]["value"] <= kept["page_in_bytes"]["value"]
    fp16 = kept["bytes_fp16_context"]["value"]
    assert kept["recall_floor_ratio"]["value"] == pytest.approx(kept["bytes_recall_floor"]["value"] / fp16)


def test_eval_reselect_reports_what_reselection_moved(tmp_path: Path) -> None:
    args = ["--gate", "certified:0.2", "--resident", "0.25", "--select", "streaming", "--reselect", "1"]
    doc, kept = _eval_resident(tmp_path / "eval", *args)
    assert untiered_numbers(doc["results"]) == [] and doc["config"]["reselect"] == 1
    assert kept["reselections"]["value"] > 0 and kept["reselect_promoted"]["tier"] == "empirical"
    assert kept["reselect_bytes_paged"]["value"] >= 0


@pytest.mark.parametrize("recall", ["transient", "swap"])
def test_eval_recall_option_reaches_the_cache(tmp_path: Path, recall: str) -> None:
    """``--recall`` builds the resident variant with that recall form: recorded in the config and the variant, 0
    violations in validate mode; ``swap`` moves recalled pages into the resident set (counted as re-selections,
    the page-in of what it promotes included), ``transient`` keeps nothing and moves nothing."""
    args = ["--gate", "certified:0.2", "--resident", "0.25", "--select", "h2o", "--validate", "--recall", recall]
    doc, kept = _eval_resident(tmp_path / recall, *args)
    assert doc["config"]["recall"] == recall and kept["recall"] == recall
    assert kept["violations"]["value"] == 0 and kept["recall_violations"]["value"] == 0
    assert kept["pages_recalled"]["value"] > 0  # the tiny model's reads recall, so the forms differ in what follows
    moved = kept.get("reselections", {"value": 0})["value"]
    assert (moved > 0) == (recall == "swap")


def test_eval_summary_option_reaches_the_cache(tmp_path: Path) -> None:
    """``--summary basis8`` / ``basis8-t2`` build the resident variant's summaries as basis sketches: recorded in
    the config and the variant, 0 violations in validate mode, and summary bytes unlike the int8 sketch's on the
    same samples (the 2-bit tail's below the int4 tail's)."""
    summary_bytes = {}
    for summary in ("int8", "basis8", "basis8-t2"):
        args = ["--gate", "certified:0.2", "--resident", "0.25", "--select", "streaming", "--validate"]
        doc, kept = _eval_resident(tmp_path / summary, *args, "--summary", summary)
        assert doc["config"]["summary"] == summary and kept["summary"] == summary
        assert kept["violations"]["value"] == 0 and kept["recall_violations"]["value"] == 0
        summary_bytes[summary] = kept["bytes_summary"]["value"]
    assert summary_bytes["int8"] > 0 and summary_bytes["basis8"] > 0
    assert summary_bytes["int8"] != summary_bytes["basis8"]
    assert 0 < summary_bytes["basis8-t2"] < summary_bytes["basis8"]


def test_eval_resident_alloc_reaches_the_cache(tmp_path: Path) -> None:
    """``--resident-alloc mass`` splits the resident variant's tokens across layers: recorded in the config and the
    variant, 0 violations in validate mode, the same resident share as the uniform split on the same samples."""
    fractions = {}
    for alloc in ("uniform", "mass"):
        args = ["--gate", "certified:0.2", "--resident", "0.25", "--select", "h2o", "--validate"]
        doc, kept = _eval_resident(tmp_path / alloc, *args, "--resident-alloc", alloc)
        assert doc["config"]["resident_alloc"] == alloc and kept["resident_alloc"] == alloc
        assert kept["violations"]["value"] == 0 and kept["recall_violations"]["value"] == 0
        fractions[alloc] = kept["resident_fraction"]["value"]
    assert fractions["mass"] == pytest.approx(fractions["uniform"])


def _captured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, task: list[str], opts: list[str]):
    """The schemes one ``kvcert <command>`` run on a tiny model would decode: with a fixed gate every variant decodes
    in one ``run_branches`` call, which is captured before it runs."""
    seen: list[Scheme] = []

    def capture(model: object, ids: object, schemes: list[Scheme], *args: object, **kwargs: object) -> list[object]:
        seen.extend(schemes)
        raise RuntimeError("captured")

    monkeypatch.setattr("kvcert.cli.workload.run_branches", capture)
    tiny = ["--model", "tiny:llama", "--context", "512", "--samples", "1", "--schemes", "int4"]
    result = runner.invoke(app, [command, *tiny, *task, *opts, "--out", str(tmp_path / "out")])
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "captured", result.output
    return [sc for sc in seen if sc.keys is not None]


COMMANDS = [("eval", ["--task", "ruler:niah_single_1"]), ("frontier", ["--tasks", "niah_single_1", "--peers", ""])]


@pytest.mark.parametrize(("command", "task"), COMMANDS)
def test_resident_variant_takes_the_runs_storage_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, task: list[str]
) -> None:
    """``--device-budget``, ``--witness`` and ``--exact-sinks`` reach the resident variant's cache as they reach the
    schemes' (the resident variant once ran under the default budget 1.0 whatever the run asked for)."""
    storage = ["--device-budget", "0.3333", "--witness", "f32", "--exact-sinks", "4", "--gate", "certified:0.2"]
    seen = _captured(tmp_path, monkeypatch, command, task, [*storage, "--resident", "0.25"])
    got = {sc.name: (sc.device_budget, sc.witness, sc.exact_sinks) for sc in seen}
    assert got == dict.fromkeys(["int4", "int4+gate", "int4+resident"], (0.3333, "f32", 4))
    assert all(sc.storage().exact_sinks == 4 for sc in seen)


@pytest.mark.parametrize(("command", "task"), COMMANDS)
def test_upgrade_reaches_the_schemes_and_not_the_resident_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, task: list[str]
) -> None:
    """``--upgrade K/V`` reaches every scheme's cache (its persistent repairs re-encode there); the resident variant,
    an eviction the store refuses upgrade codecs with, is built without them."""
    opts = ["--gate", "certified:0.2:block", "--upgrade", "int8/int4", "--resident", "0.25"]
    seen = _captured(tmp_path, monkeypatch, command, task, opts)
    got = {sc.name: sc.storage().upgrade_keys for sc in seen}
    assert got == {"int4": "int8", "int4+gate": "int8", "int4+resident": None}


@pytest.mark.parametrize(("command", "task"), COMMANDS)
def test_a_heavy_share_reaches_the_schemes_and_not_the_resident_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, task: list[str]
) -> None:
    """``--heavy-share F`` (with ``--upgrade``) makes every scheme's store token tiers; the resident variant, an
    eviction the store refuses upgrade codecs with, is built without them."""
    opts = ["--gate", "certified:0.2:block", "--upgrade", "int8/int4", "--heavy-share", "0.2", "--resident", "0.25"]
    seen = _captured(tmp_path, monkeypatch, command, task, opts)
    got = {sc.name: sc.storage().heavy_share for sc in seen}
    assert got == {"int4": 0.2, "int4+gate": 0.2, "int4+resident": None}


@pytest.mark.parametrize(("command", "task"), COMMANDS)
def test_the_bands_reach_every_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, task: list[str]
) -> None:
    """``--bands N`` is a witness option of every store: the scheme, its gated variant and its resident variant."""
    seen = _captured(
        tmp_path, monkeypatch, command, task, ["--bands", "2", "--gate", "certified:0.2", "--resident", "0.25"]
    )
    assert {sc.name: sc.storage().bands for sc in seen} == {"int4": 2, "int4+gate": 2, "int4+resident": 2}


def test_an_eval_run_records_its_upgrade_codecs_and_heavy_share(tmp_path: Path) -> None:
    tiny = ["--model", "tiny:llama", "--context", "512", "--samples", "1", "--schemes", "int4", "--max-new-tokens", "2"]
    opts = ["--task", "ruler:niah_single_1", "--gate", "certified:0.2:block", "--upgrade", "int8/int4"]
    result = runner.invoke(
        app, ["eval", *tiny, *opts, "--heavy-share", "0.2", "--bands", "4", "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["config"]["upgrade"] == "int8/int4" and doc["config"]["heavy_share"] == 0.2
    assert doc["config"]["bands"] == 4
    gated = doc["results"]["variants"]["int4+gate"]
    assert gated["upgraded_entries"]["tier"] == gated["heavy_entries"]["tier"] == "empirical"
    assert gated["heavy_entries"]["value"] > 0
