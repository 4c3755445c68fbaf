"""Figures are real PNGs, the HTML embeds them, and (with Chromium) the page renders non-blank."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvcert.report import figures
from kvcert.report.html import render, write_html
from kvcert.report.tables import ReportTable, fmt, to_rich

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_figures(tmp_path: Path) -> list[Path]:
    gen = torch.Generator().manual_seed(0)
    cert = torch.rand(6, 9, generator=gen)
    cert[0, 0] = float("nan")
    tv = torch.rand(200, generator=gen) * 0.1
    pts = [
        figures.AccuracyPoint("int4", 0.5, -0.3, 0.0, 290.0, False),
        figures.AccuracyPoint("int4+gate", 1.0, 0.0, 0.0, 600.0, True),
    ]
    return [
        figures.layer_head_map(cert, tmp_path / "heat.png", "heatmap", "TV bound"),
        figures.coverage_curve({"a": tv, "b": torch.tensor([float("nan"), 0.5])}, tmp_path / "cov.png", "cov"),
        figures.accuracy_bars(pts, 1.0, tmp_path / "acc.png"),
        figures.bytes_vs_accuracy(pts, 1024.0, 1.0, tmp_path / "bytes.png"),
        figures.bound_scatter(tv, tv * 2, tmp_path / "scatter.png", "true", "bound", "scatter"),
        figures.accuracy_vs_budget(
            {"h2o": [(0.5, 0.4, -0.8, -0.2), (0.25, 0.1, -1.0, -0.6)], "snapkv": [(0.5, 0.9, -0.2, 0.0)]},
            1.0,
            tmp_path / "budget.png",
            "budget",
        ),
        figures.codec_shares({"int8": 68.0, "int4": 36.0}, {"s": {"int8": 1.0, "int4": 0.2}}, tmp_path / "c.png", "c"),
    ]


def test_figures_are_nonempty_pngs(tmp_path: Path) -> None:
    for p in make_figures(tmp_path):
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, p


def test_figure_inputs_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layers, heads"):
        figures.layer_head_map(torch.zeros(3), tmp_path / "x.png", "t", "l")
    with pytest.raises(ValueError, match="paired"):
        figures.bound_scatter(torch.zeros(3), torch.zeros(4), tmp_path / "y.png", "x", "y", "t")


def test_table_rows_are_checked_and_formatted() -> None:
    with pytest.raises(ValueError, match="rows\\[0\\]"):
        ReportTable("t", ("a", "b"), (("1",),))
    assert fmt(None) == fmt(float("nan")) == "–"
    assert fmt(0.1234, percent=True) == "12.3%" and fmt(1234567) == "1,234,567"
    assert to_rich(ReportTable("t", ("a", "b"), (("x", "1"),))).row_count == 1


def test_html_embeds_every_image_and_escapes(tmp_path: Path) -> None:
    figs = make_figures(tmp_path)
    table = ReportTable("<scores>", ("scheme", "acc"), (("a&b", "1"),), note="note")
    page = render("title", ["para <1>"], [table], figs, "kvcert run")
    assert page.count("data:image/png;base64,") == len(figs)
    assert "&lt;scores&gt;" in page and "a&amp;b" in page and "para &lt;1&gt;" in page
    assert "http://" not in page and "https://" not in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        # CI installs Debian's chromium (.ci/run) and sets KVCERT_REQUIRE_CHROMIUM=1: there it must not skip
        assert not os.environ.get("KVCERT_REQUIRE_CHROMIUM"), "KVCERT_REQUIRE_CHROMIUM is set but no chromium found"
        pytest.skip("no chromium binary installed: HTML render check not run")
    page = write_html(
        tmp_path / "report.html",
        "render check",
        ["hello"],
        [ReportTable("t", ("a",), (("1",),))],
        make_figures(tmp_path),
        "kvcert run",
    )
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1200,1600",
            page.as_uri(),
        ],
        check=True,
        timeout=60,
        capture_output=True,
    )
    import matplotlib.image

    img = matplotlib.image.imread(shot)
    assert img.std() > 0.01, "screenshot is blank"


def test_bytes_vs_accuracy_marks_resident_points_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resident point is drawn as a diamond at its bytes with its own legend entry; a point without bytes is not
    drawn."""
    drawn: list[figures.plt.Figure] = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: drawn.append(fig) or path)
    pts = [
        figures.AccuracyPoint("int4", 0.5, -0.3, 0.0, 290.0, False),
        figures.AccuracyPoint("int4+resident", 0.75, -0.2, 0.0, 95.0, True, resident=True),
        figures.AccuracyPoint("none+gate", 1.0, 0.0, 0.0, None, True),
    ]
    figures.bytes_vs_accuracy(pts, 1024.0, 1.0, tmp_path / "bytes.png")
    (ax,) = drawn[0].axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["raw", "resident (whole-context bytes)", "dense (fp16)"]
    offsets = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert offsets == [(290.0, 0.5), (95.0, 0.75), (1024.0, 1.0)]
    assert [a.get_text() for a in ax.texts] == ["int4", "int4+resident"]


def test_codec_shares_orders_rows_by_bytes_and_skips_missing_bars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are the codecs by stored bytes, named with them; a codec absent from a series has no bar in it."""
    drawn: list[figures.plt.Figure] = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: drawn.append(fig) or path)
    size = {"int8": 68.0, "int4": 36.0, "dither-int6": 52.0}
    series = {"a": {"int8": 1.0, "int4": 0.1, "dither-int6": 0.7}, "b": {"dither-int6": 0.75}}
    figures.codec_shares(size, series, tmp_path / "c.png", "t")
    (ax,) = drawn[0].axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["int4 (36 B)", "dither-int6 (52 B)", "int8 (68 B)"]
    bars = [[(round(r.get_y() + r.get_height() / 2), r.get_width()) for r in c] for c in ax.containers]
    assert bars == [[(0, 0.1), (1, 0.7), (2, 1.0)], [(1, 0.75)]]
