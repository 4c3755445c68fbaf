"""Smoke tests of every ``kvcert`` command on a tiny random model (SmolLM2 tokenizer), at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.cli.common import auto_gate
from kvcert.cli.main import app
from kvcert.report.results import untiered_numbers, without_volatile

runner = CliRunner()
TINY = ["--model", "tiny:llama", "--seed", "0"]
RULER = ["--context", "512", "--samples", "2", "--max-new-tokens", "3"]


def invoke(*args: str) -> object:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def check_report(out: Path) -> dict:
    doc = load(out)
    assert untiered_numbers(doc["results"]) == []
    assert doc["reproducibility"]["seed"] == 0 and doc["reproducibility"]["versions"]["torch"]
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(pngs)
    assert 'src="http' not in html
    return doc


@pytest.mark.parametrize(
    "command", [[], ["run"], ["audit"], ["eval"], ["ppl"], ["merge"], ["codecs"], ["probe"], ["ledger"]]
)
def test_help(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_run_writes_report_and_reproduces(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        "run",
        *TINY,
        *RULER,
        "--tasks",
        "niah_single_1",
        "--schemes",
        "int4,dither-int8/int4",
        "--out",
        str(out),
    ]
    first = invoke(*args)
    assert "report:" in first.output and "report.html" in first.output
    doc = check_report(out)
    variants = doc["results"]["variants"]
    assert set(variants) == {"dense", "int4", "int4+gate", "dither-int8/int4", "dither-int8/int4+gate", "int8+resident"}
    kept = variants["int8+resident"]  # the run's resident variant: int8, R = 0.25, SnapKV, certified(0.2) + recall
    assert (kept["gate"], kept["select"]) == ("certified(tau=0.2, head)", "snapkv")
    assert kept["max_omitted_mass_bound"]["tier"] == "certified" and kept["bytes_recalled"]["tier"] == "empirical"
    choices = doc["results"]["gate_choice"]
    assert set(choices) == {"int4", "dither-int8/int4"}
    for label, choice in choices.items():  # the auto rule, applied to the measured informative fraction
        assert choice["gate"] == auto_gate(choice["informative_fraction"]["value"]).describe()
        assert variants[label + "+gate"]["gate"] == choice["gate"]
    for label, v in variants.items():
        if label != "dense":
            assert v["ci95_low"]["value"] <= v["diff_vs_dense"]["value"] <= v["ci95_high"]["value"]
            assert v["coverage_kv@0.2"]["tier"] == "certified" and v["accuracy"]["tier"] == "empirical"
            assert v["value_term_p90"]["tier"] == "certified" and v["value_term_p90"]["value"] >= 0
            assert v["bytes_per_token_stored"]["value"] < v["bytes_per_token_fp16"]["value"]
    assert variants["int4"]["value_term_p90"]["value"] > 0 and "value p90" in first.output  # raw int4 values
    assert len(doc["results"]["per_sample"]) == 2
    invoke(*args, "--overwrite")  # an existing report is replaced only on request
    again = load(out)
    assert without_volatile(again) == without_volatile(doc)
    assert "seconds" in again["volatile"]


def test_eval_fixed_gate_and_bad_task(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    invoke(
        "eval",
        *TINY,
        *RULER,
        "--tasks",
        "niah_single_1",
        "--schemes",
        "int2",
        "--gate",
        "certified:0",
        "--resamples",
        "200",
        "--out",
        str(out),
    )
    doc = check_report(out)
    gated = doc["results"]["variants"]["int2+gate"]
    assert gated["gate"] == "certified(tau=0, head)"
    assert gated["bootstrap_resamples"]["value"] == 200
    # tau = 0 repairs every read touching a compressed entry, so everything is paged in
    assert gated["fallback_rate"]["value"] == 1.0 and gated["page_in_bytes"]["value"] > 0
    assert doc["config"]["tasks"] == ["niah_single_1"]  # --tasks, as run and frontier take it
    bad = runner.invoke(app, ["eval", *TINY, "--task", "niah_single_1", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "ruler:" in bad.output and "--tasks" in bad.output
    both = ["--tasks", "niah_single_1", "--task", "ruler:niah_single_1"]
    bad = runner.invoke(app, ["eval", *TINY, *both, "--out", str(tmp_path / "y")])
    assert bad.exit_code == 2 and "give one of --tasks and --task" in bad.output
    bad = runner.invoke(app, ["eval", *TINY, "--tasks", "niah_nope", "--out", str(tmp_path / "z")])
    assert bad.exit_code == 2 and "unknown RULER task 'niah_nope'" in bad.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_eval_tier_b_gate_reports_its_partial_reads(tmp_path: Path) -> None:
    """``--gate certified:TAU:box:tier-b`` reaches the cache; results.json carries the Tier-B gate's numbers, each
    tiered, and the partial violations in validate mode; a scheme without dithered keys is refused by name."""
    out = tmp_path / "eval"
    common = ("eval", *TINY, *RULER, "--task", "ruler:niah_single_1", "--gate", "certified:0.2:box:tier-b")
    invoke(*common, "--schemes", "dither-int8/int4", "--validate", "--resamples", "100", "--out", str(out))
    gated = check_report(out)["results"]["variants"]["dither-int8/int4+gate"]
    assert gated["gate"] == "certified(tau=0.2, head, box, tier-b)"
    for key in ("tier_b_read_share", "tier_b_cells", "tier_b_delta_spent_max", "partial_violations"):
        assert gated[key]["tier"] == "empirical", key
    assert gated["partial_violations"]["value"] == 0 and gated["violations"]["value"] == 0
    bad = runner.invoke(app, [*common, "--schemes", "int8", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "every scheme needs dithered keys" in bad.output


def test_bad_scheme_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", *TINY, "--schemes", "int4,bogus", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "bogus" in result.output


def test_audit_validates_against_true_tv(tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    out = tmp_path / "audit"
    result = invoke(
        "audit",
        *TINY,
        "--keys",
        "dither-int8",
        "--values",
        "int4",
        "--prompt-file",
        str(prompt),
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    )
    assert "SOUNDNESS VIOLATION" not in result.output
    doc = check_report(out)
    res = doc["results"]
    assert res["violations"] == {"value": 0, "tier": "empirical"}
    assert res["coverage_tier_b_kv@0.2"]["tier"] == "partial"
    assert res["max_true_tv"]["value"] <= res["max_certificate"]["value"]
    # the exact-TV ceiling: no certificate covers more (empirical)
    assert res["ceiling_kv@0.2"]["tier"] == "empirical"
    assert res["coverage_kv@0.2"]["value"] <= res["ceiling_kv@0.2"]["value"] <= res["ceiling_q@0.2"]["value"]
    assert {
        "heatmap.png",
        "saturation.png",
        "coverage_vs_tau.png",
        "true_tv_vs_bound.png",
        "tier_a_vs_tier_b.png",
    } <= {p.name for p in out.glob("*.png")}
    both = runner.invoke(app, ["audit", *TINY, "--keys", "int4", "--out", str(tmp_path / "y")])
    assert both.exit_code == 2 and "exactly one" in both.output


def test_ppl_reads_through_compressed_cache(tmp_path: Path) -> None:
    out = tmp_path / "ppl"
    invoke(
        "ppl",
        *TINY,
        "--context",
        "96",
        "--windows",
        "1",
        "--chunk",
        "16",
        "--schemes",
        "int2",
        "--gate",
        "certified:0",
        "--out",
        str(out),
    )
    doc = load(out)
    assert untiered_numbers(doc["results"]) == []
    v = doc["results"]["variants"]
    dense, raw, gated = v["dense"], v["int2"], v["int2+gate"]
    assert dense["scored_tokens"]["value"] == raw["scored_tokens"]["value"] == 48
    # int2 keys/values change the logits of the continuation; tau=0 gating repairs every read back to exact
    assert raw["perplexity"]["value"] != dense["perplexity"]["value"]
    assert gated["perplexity"]["value"] == pytest.approx(dense["perplexity"]["value"], rel=1e-4)
