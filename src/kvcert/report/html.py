"""A self-contained HTML report: tables and base64-embedded PNGs, no external resources."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

from kvcert.report.results import write_atomic
from kvcert.report.tables import ReportTable

_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#eee}figure{display:inline-block;margin:1em}
img{max-width:560px;border:1px solid #ddd}.note{color:#555;font-size:90%}
pre{background:#f6f6f6;padding:6px}"""


def table_html(table: ReportTable) -> str:
    """One ``<table>`` with its title as caption and its note below."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table.rows)
    note = f'<p class="note">{html.escape(table.note)}</p>' if table.note else ""
    return (
        f"<h3>{html.escape(table.title)}</h3><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"
    )


def figure_html(png: Path) -> str:
    """An ``<img>`` with the PNG embedded as a base64 data URI, captioned by its file name."""
    data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(png.stem)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(png.name)}</figcaption></figure>"
    )


def render(
    title: str,
    paragraphs: Sequence[str],
    tables: Sequence[ReportTable],
    figures: Sequence[Path],
    command: str,
) -> str:
    """The full HTML page: title, paragraphs, the exact command, tables, then figures (all inline)."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
    ]
    parts += [f"<p>{html.escape(p)}</p>" for p in paragraphs]
    parts.append(f"<pre>{html.escape(command)}</pre>")
    parts += [table_html(t) for t in tables]
    parts.append("<h2>Figures</h2>")
    parts += [figure_html(f) for f in figures]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(
    path: Path,
    title: str,
    paragraphs: Sequence[str],
    tables: Sequence[ReportTable],
    figures: Sequence[Path],
    command: str,
) -> Path:
    """Write :func:`render` to ``path`` (atomically, never through a link: :func:`write_atomic`)."""
    return write_atomic(path, render(title, paragraphs, tables, figures, command).encode("utf-8"))
