"""How much of a resident set's recall traffic is the bound's, and how much the design's? Page-in, recall and the
recall floor of validated ``benchmarks/capacity_ruler.py`` runs, side by side.

The recall floor (``docs/eviction.md#the-recall-floor``) is, read by read, the K/V of the fewest omitted pages any
sound recall must serve for what it leaves out to hold at most τ of the exact attention: no summary, however tight,
pages in less. So ``recall / floor`` is what the bound's looseness costs, and a floor above the page-in target means
no bound meets it with that resident set. Reads the ``results.json`` of capacity_ruler runs made with ``--validate``
and a resident variant (any model, context, seed or options: each run is its own row) and prints one row per
resident variant: resident share, summary, capacity, page-in, recall and floor over the request, the two read shares
that send traffic (omitted-mass bound above 0.2, exact omitted mass above 0.2), and the violations. Traffic is
converted to fp16 bytes of the request's K/V (the unit of issue 16's 5 % target) with the host tier's measured
entry size (``bytes_host / bytes_fp16`` of the variant: 2 for a float32 host tier). With ``--plot``, a figure of
page-in and floor against capacity with the target.

Usage: ``.venv/bin/python benchmarks/recall_floor.py RUN_DIR [RUN_DIR ...] [--plot FILE] [--title TEXT]``.
Tiers: traffic, floor, capacity and the exact-mass share measured; the bound share certified; accuracy empirical.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402
from rich.console import Console  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402
from repair_forms import TARGET_PAGE_IN, load_run, runs_parser, save_figure  # noqa: E402

TICKS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)  # x-axis ticks of the figure (log scale)


def rows_of(path: Path) -> list[dict[str, Any]]:
    """One row per validated resident variant of the run in ``path`` (a capacity_ruler ``--out`` directory)."""
    run = load_run(path)
    cfg, out = run["config"], []
    for name, v in run["results"]["variants"].items():
        if "bytes_recall_floor" not in v:
            continue
        x = {k: e["value"] for k, e in v.items() if isinstance(e, dict) and "value" in e}
        host = x["bytes_host"] / x["bytes_fp16"]  # host entry size / 2 bytes, measured from the stored tensors
        fp16 = x["bytes_fp16_request"] * host
        out.append(
            {
                "run": f"{cfg['model']} {cfg['context'] // 1024}k s{cfg['seed']}",
                "variant": name,
                "summary": cfg["resident"]["summary"],
                "resident": x["resident_fraction"],
                "capacity": x["capacity_request"],
                "accuracy": x["accuracy"],
                "dense_accuracy": run["results"]["variants"]["dense"]["accuracy"]["value"],
                "page_in": x["page_in_bytes"] / fp16,
                "recall": x["bytes_recalled"] / fp16,
                "floor": x["bytes_recall_floor"] / fp16,
                "keys_share": x["bytes_recalled_keys"] / x["bytes_recalled"]
                if "bytes_recalled_keys" in x and x["bytes_recalled"]
                else None,
                "bound_above": x["reads_mass_bound_above"] / x["resident_reads"],
                "exact_above": x["reads_mass_above"] / x["resident_reads"],
                "violations": f"{x['violations']} + {x['recall_violations']}",
                "samples": x["samples"],
            }
        )
    if not out:
        raise SystemExit(f"{path}: no validated resident variant (capacity_ruler.py needs --resident and --validate)")
    return out


def table(rs: list[dict[str, Any]]) -> ReportTable:
    cells = tuple(
        (
            r["run"],
            r["variant"],
            r["summary"],
            fmt(r["resident"], percent=True),
            fmt(r["capacity"], 4),
            f"{fmt(r['accuracy'], percent=True)} ({fmt(r['dense_accuracy'], percent=True)})",
            fmt(r["page_in"], 3),
            fmt(r["recall"], 3),
            fmt(r["floor"], 3),
            fmt(r["recall"] / r["floor"] if r["floor"] else None, 2),
            fmt(r["keys_share"], percent=True),
            fmt(r["bound_above"], percent=True),
            fmt(r["exact_above"], percent=True),
            r["violations"],
            str(r["samples"]),
        )
        for r in rs
    )
    return ReportTable(
        "page-in, recall and the recall floor per validated resident variant (× the request's fp16 K/V)",
        (
            "run",
            "variant",
            "summary",
            "resident",
            "capacity",
            "acc (dense)",
            "page-in",
            "recall",
            "floor",
            "recall / floor",
            "keys of recall",
            "reads m̄>0.2",
            "reads m>0.2",
            "violations",
            "samples",
        ),
        cells,
        f"traffic over the request in fp16 bytes of its K/V (target page-in <= {TARGET_PAGE_IN}); floor = what any "
        "sound page-granular recall pages in at the same reads; keys of recall = share of the recalled bytes that are "
        "keys (paged in to replace summary bounds by exact logits; runs made before this column: –); reads m̄>0.2 / "
        "m>0.2 = KV-head reads whose omitted-mass bound / exact omitted mass exceeds 0.2 before recall; violations = "
        "cells + recall (validate mode, must be 0). Tiers: traffic, floor, capacity, reads m>0.2 measured; reads "
        "m̄>0.2 certified; acc empirical.",
    )


def plot(rs: list[dict[str, Any]], path: Path, title: str) -> None:
    """One line per variant (labelled with its capacity): page-in (filled) and recall floor (open) on a log axis,
    joined, with the page-in target."""
    fig, ax = plt.subplots(figsize=(10.0, 0.45 * len(rs) + 1.6))
    ys = list(range(len(rs)))[::-1]
    for y, r in zip(ys, rs, strict=True):
        ax.plot([r["floor"], r["page_in"]], [y, y], color="tab:grey", linewidth=1)
    ax.scatter([r["page_in"] for r in rs], ys, color="tab:orange", s=50, label="page-in over the request", zorder=3)
    ax.scatter([r["floor"] for r in rs], ys, facecolors="white", edgecolors="k", s=50, label="recall floor", zorder=3)
    ax.axvline(TARGET_PAGE_IN, color="tab:red", linestyle="--", linewidth=1, label=f"page-in target ({TARGET_PAGE_IN})")
    labels = [f"{r['run']}: {r['variant']}, R={r['resident']:.2f}, {r['summary']} ({r['capacity']:.2f}×)" for r in rs]
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xscale("log")
    lo, hi = min(r["floor"] for r in rs), max(r["page_in"] for r in rs)
    ax.set_xticks([t for t in TICKS if lo / 2 <= t <= 2 * hi], minor=False)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("× the request's fp16 K/V (measured)")
    ax.set_title(f"{title}\nrecall floor: what any sound bound pages in at the same reads", fontsize=9)
    save_figure(fig, ax, path)


def main() -> None:
    args = runs_parser(__doc__, "capacity_ruler --out directories made with --validate", "recall floor").parse_args()
    rs = [r for p in args.runs for r in rows_of(p)]
    print_table(Console(), table(rs))
    if args.plot is not None:
        plot(rs, args.plot, args.title)
        print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
