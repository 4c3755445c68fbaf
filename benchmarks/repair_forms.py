"""What does each repair form cost? Page-in against capacity for the same schemes under the head gate, the block
gate (blocks written back exact) and the transient block gate, on the same RULER samples.

Reads the ``results.json`` of ``benchmarks/capacity_ruler.py`` runs that differ only in ``--gate`` (one run per gate
form: the same model, context, seed, tasks and samples, hence the same prompts and the same dense answers, which is
checked: runs that did not decode the same samples are refused). Prints one row per (scheme, gate form): accuracy and
its paired Δ against dense, device bytes per token and capacity (what stays on the device), page-in over the request
and per decode step (what crosses the host link), the share of KV-head reads repaired from the exact copy, and
writes a figure of page-in (log scale) against capacity with the issue-16 page-in target.

Usage: ``.venv/bin/python benchmarks/repair_forms.py RUN_DIR [RUN_DIR ...] [--plot FILE] [--title TEXT]``.
Tiers: accuracy and Δ empirical; bytes, capacity, page-in and repair shares measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402

from kvcert.cli.workload import GATED_SUFFIX  # noqa: E402
from kvcert.report.results import load_json_object  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402

TARGET_PAGE_IN = 0.05  # issue 16: page-in <= 5 % of the request's fp16 K/V bytes
SAME_RUN = ("model", "context", "seed", "tasks", "samples_per_task")
MARKERS = {"head": "o", "block, transient": "s", "block, persistent": "^"}


def load_run(path: Path) -> dict:
    """The ``results.json`` of one capacity_ruler run directory (or the file itself)."""
    f = path / "results.json" if path.is_dir() else path
    if not f.is_file():
        raise SystemExit(f"{path}: no results.json (a benchmarks/capacity_ruler.py --out directory is expected)")
    try:
        return load_json_object(f)
    except ValueError as exc:  # unreadable or not a results document: one line naming the file
        raise SystemExit(str(exc)) from None


def samples_of(run: dict) -> list[tuple[str, int, str]]:
    """``(task, index, dense prediction)`` of every journaled sample, in order."""
    return [(s["task"], s["index"]["value"], s["predictions"]["dense"]) for s in run["results"]["per_sample"]]


def check_same(runs: list[tuple[Path, dict]]) -> None:
    """Refuse runs that did not decode the same samples with the same dense answers."""
    (p0, r0), rest = runs[0], runs[1:]
    for p, r in rest:
        for key in SAME_RUN:
            if r["config"][key] != r0["config"][key]:
                raise SystemExit(f"{p} and {p0} differ in {key}: {r['config'][key]!r} vs {r0['config'][key]!r}")
        if samples_of(r) != samples_of(r0):
            raise SystemExit(f"{p} and {p0} did not decode the same samples (or dense answered differently)")


def form(gate: str) -> str:
    """The repair form of a gate label: ``certified(tau=0.2, block, persistent)`` -> ``block, persistent``,
    ``certified(tau=0.2, block, transient)`` (``certified(tau=0.2, block)`` in runs labelled before the transient
    form was named) -> ``block, transient``, ``certified(tau=0.2, head)`` -> ``head``; a box or Tier-B gate keeps its
    suffix (``block, transient, box, tier-b``), drawn with the marker of its repair unit (hollow for Tier B)."""
    unit = gate.split(", ", 1)[1].rstrip(")")
    return "block, transient" if unit == "block" else unit


def rows(runs: list[tuple[Path, dict]]) -> list[dict]:
    """One row per gated variant of every run."""
    out = []
    for _, run in runs:
        for name, v in run["results"]["variants"].items():
            if v["kind"] != "gated":
                continue
            value = {k: x["value"] for k, x in v.items() if isinstance(x, dict) and "value" in x}
            out.append({"scheme": name.removesuffix(GATED_SUFFIX), "form": form(v["gate"]), **value})
    return sorted(out, key=lambda r: (r["scheme"], r["form"]))


def table(rs: list[dict], dense_acc: float, n: int) -> ReportTable:
    cells = tuple(
        (
            r["scheme"],
            r["form"],
            fmt(r["accuracy"], percent=True),
            f"{100 * r['diff_vs_dense']:+.1f} [{100 * r['ci95_low']:+.1f}, {100 * r['ci95_high']:+.1f}]",
            fmt(r["bytes_per_token_device_request"], 5),
            fmt(r["capacity_request"], 4),
            fmt(r["page_in_request"], 3),
            fmt(r["page_in_per_step"], 3),
            fmt(r["fallback_rate"], percent=True),
        )
        for r in rs
    )
    return ReportTable(
        f"repair forms on the same {n} samples (dense accuracy {100 * dense_acc:.1f}%)",
        (
            "scheme",
            "repair",
            "acc",
            "Δ vs dense [95% CI] (pp)",
            "device B/token",
            "capacity",
            "page-in ×fp16",
            "page-in/step",
            "repaired reads",
        ),
        cells,
        "page-in ×fp16 = host page-in over the request / the request's fp16 K/V bytes (target <= 0.05), in the host "
        "tier's dtype; repaired reads = KV-head reads served partly from the exact copy. Tiers: acc, Δ empirical; "
        "bytes, capacity, page-in, repaired reads measured.",
    )


def plot(rs: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    schemes = sorted({r["scheme"] for r in rs})
    colors = dict(zip(schemes, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for r in rs:
        partial = "tier-b" in r["form"]  # the Tier-B gate's forms: hollow (some reads partially certified)
        ax.scatter(
            r["capacity_request"],
            r["page_in_request"],
            edgecolors=colors[r["scheme"]],
            facecolors="none" if partial else colors[r["scheme"]],
            marker=MARKERS.get(r["form"].split(", box")[0], "x"),
            s=60,
            label=f"{r['scheme']}, {r['form']}",
        )
    ax.axhline(TARGET_PAGE_IN, color="grey", linestyle="--", linewidth=1, label="page-in target (0.05)")
    ax.set_yscale("log")
    ax.set_xlabel("capacity (fp16 K/V bytes / device bytes)")
    ax.set_ylabel("page-in over the request (× its fp16 K/V)")
    ax.set_title(title)
    save_figure(fig, ax, path)


def save_figure(fig: plt.Figure, ax: plt.Axes, path: Path) -> None:
    """Put the legend right of the axes, write the figure to ``path`` (PNG) and close it."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def runs_parser(doc: str, runs_help: str, title: str) -> argparse.ArgumentParser:
    """The command line of the scripts that read capacity_ruler runs: the run directories, ``--plot``, ``--title``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help=runs_help)
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    ap.add_argument("--title", default=title)
    return ap


def main() -> None:
    runs_help = "capacity_ruler --out directories, one per gate form"
    args = runs_parser(__doc__, runs_help, "page-in against capacity per repair form").parse_args()
    runs = [(p, load_run(p)) for p in args.runs]
    check_same(runs)
    rs = rows(runs)
    dense = runs[0][1]["results"]["variants"]["dense"]
    print_table(Console(), table(rs, dense["accuracy"]["value"], dense["samples"]["value"]))
    if args.plot is not None:
        plot(rs, args.plot, args.title)
        print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
