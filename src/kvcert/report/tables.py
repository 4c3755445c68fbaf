"""Plain tables shared by the terminal (rich) and the HTML report, so both show the same cells."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class ReportTable:
    """A titled table of already formatted cells; ``rows`` must all have ``len(columns)`` cells."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""

    def __post_init__(self) -> None:
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"rows[{i}] has {len(row)} cells, expected {len(self.columns)}")


def fmt(value: float | int | None, digits: int = 3, percent: bool = False) -> str:
    """Format a number for a table cell; ``None``/NaN print as ``–``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if percent:
        return f"{100 * value:.1f}%"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def to_rich(table: ReportTable) -> Table:
    """The table as a ``rich.table.Table`` (numbers right-aligned, first column left)."""
    out = Table(title=table.title, caption=table.note or None)
    for i, col in enumerate(table.columns):
        out.add_column(col, justify="left" if i == 0 else "right")
    for row in table.rows:
        out.add_row(*row)
    return out


def to_markdown(table: ReportTable) -> str:
    """The table as GitHub markdown (title in bold, numbers right-aligned, the note below), every cell in full."""

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    align = tuple(":--" if i == 0 else "--:" for i in range(len(table.columns)))
    lines = [f"**{table.title}**", "", line(table.columns), line(align), *(line(row) for row in table.rows)]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines)


def print_table(console: Console, table: ReportTable) -> None:
    """Print ``table`` readably wherever the output goes: a rich table on a terminal; markdown, never cut to the
    console width, when stdout is a file or a pipe (rich would otherwise truncate cells to 80 columns)."""
    if console.is_terminal:
        console.print(to_rich(table))
    else:
        console.print(to_markdown(table), crop=False, soft_wrap=True, markup=False, highlight=False)
