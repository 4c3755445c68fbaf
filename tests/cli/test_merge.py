from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.cli.main import app
from kvcert.cli.merge import load_shard, merge_results
from kvcert.eval.stats import mcnemar, paired_bootstrap
from kvcert.report.results import untiered_numbers

runner = CliRunner()


def _t(v):
    return {"value": v, "tier": "empirical"}


def _shard(task: str, dense: list[float], raw: list[float], cells: int, cov: float, page: int, gate="off") -> dict:
    per_sample = [
        {"task": task, "index": _t(i), "scores": {"dense": _t(d), "int2": _t(r)}}
        for i, (d, r) in enumerate(zip(dense, raw, strict=True))
    ]
    tel = {
        "cells": _t(cells),
        "coverage_kv@0.2": _t(cov),
        "informative_fraction": _t(cov),
        "fallback_rate": _t(0.5 * cov),
        "effective_bits": _t(4.0 + cov),
        "page_in_bytes": _t(page),
        "fail_closed": _t(0),
        "max_certificate": _t(cov),
        "bytes_per_token_fp16": _t(100.0),
        "bytes_per_token_stored": _t(30.0 + cov),
    }
    return {
        "command": "eval",
        "config": {"model": "m"},
        "results": {
            "variants": {
                "dense": {"gate": "off", "codecs": None},
                "int2": {"gate": gate, "codecs": {"keys": "int2"}, **tel},
            },
            "per_sample": per_sample,
        },
    }


def test_merge_equals_one_run_over_all_samples():
    a = _shard("t1", [1, 1, 0, 1], [0, 1, 0, 0], cells=100, cov=0.2, page=10)
    b = _shard("t2", [1, 0, 1], [1, 0, 0], cells=300, cov=0.6, page=5)
    merged = merge_results([a, b], [Path("a"), Path("b")], seed=3, resamples=500)
    assert untiered_numbers(merged) == []
    v = merged["variants"]["int2"]
    dense, raw = [1, 1, 0, 1, 1, 0, 1], [0, 1, 0, 0, 1, 0, 0]
    boot = paired_bootstrap(dense, raw, resamples=500, seed=3)
    assert v["accuracy"]["value"] == pytest.approx(2 / 7)
    assert (v["ci95_low"]["value"], v["ci95_high"]["value"]) == (boot.low, boot.high)
    assert v["mcnemar_p"]["value"] == mcnemar([d >= 1 for d in dense], [r >= 1 for r in raw]).p_exact
    assert v["coverage_kv@0.2"]["value"] == pytest.approx((0.2 * 100 + 0.6 * 300) / 400)
    assert v["coverage_kv@0.2"]["tier"] == "certified"
    assert v["page_in_bytes"]["value"] == 15 and v["cells"]["value"] == 400
    assert [x["value"] for x in v["bytes_per_token_stored_per_shard"]] == [30.2, 30.6]
    assert merged["variants"]["dense"]["samples"]["value"] == 7


def test_merge_pools_a_tier_b_gates_numbers():
    """A Tier-B gate's numbers merge as one run's would: the share of reads on Tier B weighted by cells, the cells
    charged and partial violations summed, the most δ a request spent maximised; absent elsewhere."""
    a = _shard("t1", [1, 1], [1, 0], cells=100, cov=0.2, page=10)
    b = _shard("t2", [1], [1], cells=300, cov=0.6, page=5)
    for shard, share, cells, spent in ((a, 0.1, 7, 1e-6), (b, 0.3, 5, 3e-6)):
        shard["results"]["variants"]["int2"].update(
            tier_b_read_share=_t(share),
            tier_b_cells=_t(cells),
            tier_b_delta_spent_max=_t(spent),
            partial_violations=_t(0),
        )
    merged = merge_results([a, b], [Path("a"), Path("b")], seed=3, resamples=100)
    v = merged["variants"]["int2"]
    assert v["tier_b_read_share"]["value"] == pytest.approx((0.1 * 100 + 0.3 * 300) / 400)
    assert (v["tier_b_cells"]["value"], v["partial_violations"]["value"]) == (12, 0)
    assert v["tier_b_delta_spent_max"]["value"] == 3e-6
    plain = merge_results([_shard("t1", [1], [1], 1, 0.1, 0)], [Path("c")], seed=3, resamples=100)
    assert "tier_b_read_share" not in plain["variants"]["int2"]


def test_merge_rejects_overlap_and_gate_mismatch():
    a = _shard("t1", [1], [0], cells=1, cov=0.1, page=0)
    with pytest.raises(ValueError, match="disjoint"):
        merge_results([a, a], [Path("a"), Path("a2")], 0, 100)
    b = _shard("t2", [1], [0], cells=1, cov=0.1, page=0, gate="certified(tau=0.2)")
    with pytest.raises(ValueError, match="gate"):
        merge_results([a, b], [Path("a"), Path("b")], 0, 100)


def test_load_shard_names_the_problem(tmp_path: Path):
    with pytest.raises(ValueError, match="no results.json"):
        load_shard(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"command": "ppl", "results": {}}))
    with pytest.raises(ValueError, match="per-sample"):
        load_shard(tmp_path)


def test_cli_merges_two_real_eval_shards(tmp_path: Path):
    common = [
        "--model",
        "tiny:llama",
        "--seed",
        "0",
        "--context",
        "512",
        "--samples",
        "2",
        "--max-new-tokens",
        "3",
        "--schemes",
        "int2",
        "--gate",
        "certified:0.2",
        "--resamples",
        "200",
    ]
    for name, task in (("a", "niah_single_1"), ("b", "niah_single_2")):
        res = runner.invoke(app, ["eval", *common, "--task", f"ruler:{task}", "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    out = tmp_path / "merged"
    res = runner.invoke(
        app, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--resamples", "200"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["command"] == "merge" and untiered_numbers(doc["results"]) == []
    assert doc["results"]["variants"]["dense"]["samples"]["value"] == 4
    # the merged table has eval's columns, and its bytes per token are what one run over both shards gives
    shards = [json.loads((tmp_path / n / "results.json").read_text())["results"]["variants"] for n in "ab"]
    merged = doc["results"]["variants"]
    for lab in ("dense", "int2+gate"):
        assert merged[lab]["bytes_per_token_fp16"] == shards[0][lab]["bytes_per_token_fp16"]
    device = sum(v["int2+gate"]["bytes_device"]["value"] for v in shards)
    fp16 = sum(v["int2+gate"]["bytes_fp16"]["value"] for v in shards)
    want = shards[0]["int2+gate"]["bytes_per_token_fp16"]["value"] * device / fp16
    assert abs(merged["int2+gate"]["bytes_per_token_device"]["value"] - want) <= 1e-9 * want
    header = lambda text: next(line for line in text.splitlines() if "scheme" in line and "McN p" in line)  # noqa: E731
    assert (
        header(res.output).split()
        == header(runner.invoke(app, ["eval", *common, "--out", str(tmp_path / "a"), "--overwrite"]).output).split()
    )
    assert (out / "accuracy.png").stat().st_size > 1000
    assert "data:image/png;base64," in (out / "report.html").read_text()
    bad = runner.invoke(app, ["merge", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "disjoint" in bad.output


def test_tier_b_table_lists_only_tier_b_variants():
    from kvcert.cli.ruler_report import tier_b_table

    v = {"gate": "g", "tier_b_read_share": _t(0.25), "tier_b_cells": _t(12), "tier_b_delta_spent_max": _t(3e-6)}
    table = tier_b_table({"variants": {"dense": {"gate": "off"}, "x": v}})
    assert table is not None and table.rows == (("x", "25.0%", "12", "3e-06", "–"),)
    assert tier_b_table({"variants": {"dense": {"gate": "off"}}}) is None
