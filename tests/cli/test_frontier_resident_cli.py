"""``kvcert frontier --resident``: the resident variants of ``kvcert eval`` beside the schemes and peers."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.cli.frontier import frontier_points
from kvcert.cli.main import app

from .test_capacity_cli import tiny_allocation
from .test_main_cli import RULER, TINY, check_report, invoke
from .test_resident_cli import BAD_RESIDENT

runner = CliRunner()
FRONTIER = [*TINY, *RULER, "--tasks", "niah_single_1", "--schemes", "int4", "--resamples", "200"]
CONTEXT_FIELDS = ("bytes_per_token_device_context", "capacity_context", "page_in_ratio_context")


@pytest.mark.parametrize(("args", "needle"), BAD_RESIDENT)
def test_frontier_refuses_bad_resident_options_as_eval_does(tmp_path: Path, args: list[str], needle: str) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["frontier", *FRONTIER, "--peers", "", *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcert frontier: error:") and needle in lines[0], result.output
    assert not out.exists()


def test_frontier_resident_variant_at_whole_context_bytes(tmp_path: Path) -> None:
    pytest.importorskip("optimum.quanto")
    out = tmp_path / "frontier"
    result = invoke(
        "frontier",
        *FRONTIER,
        "--samples",
        "1",
        "--gate",
        "certified:0.2",
        "--peers",
        "quanto-int2",
        "--residual-length",
        "8",
        "--resident",
        "0.25",
        "--summary",
        "basis8",
        "--resident-alloc",
        "mass",
        "--out",
        str(out),
    )
    doc = check_report(out)
    config = doc["config"]
    assert (config["resident"], config["select"], config["summary"], config["resident_alloc"]) == (
        0.25,
        "snapkv",
        "basis8",
        "mass",
    )
    assert config["resident_gate"] == "certified(tau=0.2, head)"
    variants = doc["results"]["variants"]
    assert {label: v["kind"] for label, v in variants.items()} == {
        "dense": "dense",
        "int4": "raw",
        "int4+gate": "gated",
        "int4+resident": "resident",
        "hf:quanto-int2(r=8)": "peer",
    }
    kept = variants["int4+resident"]
    assert (kept["select"], kept["summary"], kept["resident_alloc"]) == ("snapkv", "basis8", "mass")
    assert {k: kept[k]["tier"] for k in CONTEXT_FIELDS} == dict.fromkeys(CONTEXT_FIELDS, "empirical")
    context = kept["bytes_fp16_context"]["value"]  # every written token; bytes_fp16 counts the resident ones
    assert context == variants["int4"]["bytes_fp16"]["value"] > kept["bytes_fp16"]["value"]
    per_token, capacity, page_in = (kept[k]["value"] for k in CONTEXT_FIELDS)
    fp16_token = variants["dense"]["bytes_per_token_fp16"]["value"]
    assert capacity == pytest.approx(context / kept["bytes_device"]["value"])
    assert per_token == pytest.approx(fp16_token / capacity)
    assert page_in == pytest.approx(kept["page_in_bytes"]["value"] / context)
    assert set(doc["results"]["per_sample"][0]["scores"]) == set(variants)
    # the table row shows the whole-context numbers, not the resident-only ones
    row = next(line for line in result.output.splitlines() if line.startswith("| int4+resident "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["resident", "certified(tau=0.2, head)"]
    assert cells[5:8] == [f"{per_token:.4g}", f"{capacity:.2g}", f"{page_in:.3g}"]
    assert f"{kept['capacity']['value']:.2g}" != cells[6]  # the resident-only capacity is another number
    html = (out / "report.html").read_text()
    assert "Resident variants: R = 0.25 chosen by snapkv, summary basis8, split mass" in html
    # the plot: the resident point at its whole-context bytes, flagged resident; the others are not
    points = {p.label: p for p in frontier_points(doc["results"])}
    assert set(points) == set(variants) - {"dense"}
    assert points["int4+resident"].resident and points["int4+resident"].bytes_per_token == per_token
    assert not any(p.resident for label, p in points.items() if label != "int4+resident")
    assert (points["int4"].gated, points["int4+gate"].gated, points["hf:quanto-int2(r=8)"].gated) == (
        False,
        True,
        None,
    )
    assert (out / "frontier.png").is_file()


def test_frontier_plots_an_allocation_beside_the_schemes(tmp_path: Path) -> None:
    path = tiny_allocation(tmp_path / "alloc.json")
    out = tmp_path / "frontier"
    invoke(
        "frontier",
        *FRONTIER,
        "--samples",
        "1",
        "--peers",
        "",
        "--gate",
        "certified:0.2",
        "--allocation",
        str(path),
        "--out",
        str(out),
    )
    labels = {p.label for p in frontier_points(check_report(out)["results"])}
    assert {"allocated", "allocated+gate"} <= labels
