"""Tables stay readable when stdout is not a terminal: every cell in full, nothing cut to 80 columns."""

from __future__ import annotations

import io

from rich.console import Console

from kvcert.report.tables import ReportTable, print_table, to_markdown

WIDE = ReportTable(
    "kvcert run: smollm2-135m",
    ("scheme", "raw accuracy (Δ pp)", "gated accuracy (Δ pp)", "informative cells", "effective bits | tier"),
    (("dither-int8 K / int4 V", "68.4% (−1.0 [−3.9, +2.0])", "69.6% (+0.2 [−1.7, +2.7])", "100.0%", "7.9912345"),),
    note="accuracy empirical; coverage certified (Tier A)",
)


def _printed(console_kw: dict) -> str:
    buf = io.StringIO()
    print_table(Console(file=buf, width=80, **console_kw), WIDE)
    return buf.getvalue()


def test_piped_output_is_markdown_with_every_cell_in_full():
    out = _printed({})
    assert out.strip() == to_markdown(WIDE)
    assert max(len(line) for line in out.splitlines()) > 80  # not cut to the console width
    for cell in (*WIDE.columns[:-1], *WIDE.rows[0]):
        assert cell in out
    assert "effective bits \\| tier" in out  # a pipe inside a cell is escaped
    assert "…" not in out
    assert out.splitlines()[3] == "| :-- | --: | --: | --: | --: |"
    assert WIDE.note in out


def test_terminal_output_is_a_rich_table():
    out = _printed({"force_terminal": True})
    assert "┃" in out or "│" in out
    assert "kvcert run: smollm2-135m" in out
