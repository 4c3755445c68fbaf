"""How many more real reads do the uniform-law box and the order-statistics box pass than the union box? Per KV-head
read of a real model
(the last ``--queries`` positions of a text, as in ``benchmarks/tv_box_tightness.py``), with dithered keys
(``--codecs``, one row each), optionally in token tiers (``--heavy CODEC``: ``--heavy-frac`` of each KV head's tokens,
those the prefill attends to most, in that codec; ``tv_box_tightness.py``'s :class:`Tiers`):

* ``union box``: the box over ``min(Tier A, Tier B)`` radii, the sub-Gaussian union radius
  (``docs/math.md#tier-b-in-the-box``);
* ``uniform box``: the same box over the uniform-law radii (:func:`kvcert.bounds.tier_b_radius_uniform`,
  ``docs/math.md#tier-b-uniform``), the Tier-B gate's bound;
* ``order-stat``: the least of it and :func:`kvcert.bounds.order_stats.order_stat_box`
  (``docs/math.md#order-statistics-box``): the union radius only on the counted tokens past each level ``z·σ_t``;
  the failure budget ``δ_loc`` split in halves between the union radius and the counts;
* ``exact``: the exact TV, the ceiling of every sound bound (empirical);
* ``3σ`` / ``2σ``: the box with every token's radius ``min(z·σ_t, radius_t)``, what a bound that kept each token within
  ``z`` of its scale would give (an oracle of how tight a Tier-B bound must be, not a bound).

Shares are of cells (query head × read) and of KV-head reads (every query head of the read within τ = 0.2: what a head
gate passes). Every bound here takes ``δ_loc/2`` for its radii (the other half pays for the order statistics' counts),
so the columns compare at one budget. Violations: cells whose exact TV exceeds the uniform box or the order-stat
bound (on this draw; must be 0). Tiers: the boxes and order-stat partially certified (non-adaptive queries), exact
and the oracles empirical.

Usage: ``OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/order_stat_box.py [--model gemma3-270m]
[--codecs dither-int5+bypass8] [--heavy dither-int8+bypass8] [--heavy-frac 0.2] [--samples 2] [--tokens 2048]
[--queries 8] [--seed 13] [--plot FILE] [--delta-loc D]``. ``--heavy none``: every token in the row's codec;
``--delta-loc``: another per-cell failure budget than the model's default (what a larger budget would buy).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert import ValidationConfig  # noqa: E402
from kvcert.bounds import band_norms, tier_a_radius, true_tv, tv_box  # noqa: E402
from kvcert.bounds.order_stats import exceedance_counts, order_stat_box  # noqa: E402
from kvcert.bounds.radii import tier_b_radius, tier_b_radius_uniform, tier_b_sigma2  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.kernels import numba_box  # noqa: E402
from kvcert.models.zoo import load  # noqa: E402
from kvcert.quant import get  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402
from tv_box_tightness import BANDS, TAU, Tiers, heavy_tokens  # noqa: E402
from witness_tightness import Captured, capture, coded_reads, texts  # noqa: E402

#: the oracle radii ``z·σ_t`` shown beside the bounds
ORACLE_Z: tuple[float, ...] = (3.0, 2.0)
COLUMNS: tuple[str, ...] = ("union box", "uniform box", "order-stat", *(f"{z:g}σ" for z in ORACLE_Z), "exact")


def cell_bounds(
    served: torch.Tensor,
    exact: torch.Tensor,
    visible: torch.Tensor,
    tier_a: torch.Tensor,
    sigma2: torch.Tensor,
    uniform: torch.Tensor,
    delta_loc: float,
) -> dict[str, torch.Tensor]:
    """Per cell of one read (logits ``served``, ``exact`` and ``visible`` ``[G, nq, S]``; Tier-A radii and Tier-B
    proxies ``σ²`` and uniform-law radii at ``δ_loc/2`` broadcast to them): the value of each of :data:`COLUMNS`. The
    union radius and the counts take ``δ_loc/2`` each, so the order-stat bound holds for a query independent of the
    dither with probability at least ``1 − δ_loc`` per cell; the counts are over the read's ``S`` tokens (its visible
    ones are fewer, never more)."""
    ninf = float("-inf")
    p = torch.softmax(served.masked_fill(~visible, ninf), -1)
    s = served.shape[-1]
    radius = torch.minimum(tier_a, tier_b_radius(sigma2, s, delta_loc / 2)).expand_as(p).masked_fill(~visible, 0.0)
    sigma = (sigma2.sqrt() * (1.0 + 2.0**-52)).expand_as(p).masked_fill(~visible, 0.0)  # sqrt rounded up
    union = tv_box(p, radius, rows=numba_box.box_rows)
    counts = exceedance_counts(s, delta_loc / 2)
    ordered = order_stat_box(p, radius, sigma, torch.zeros_like(p), counts, rows=numba_box.box_rows)
    boxed = torch.minimum(tier_a, uniform).expand_as(p).masked_fill(~visible, 0.0)
    out = {"union box": union, "uniform box": tv_box(p, boxed, rows=numba_box.box_rows)}
    out["order-stat"] = torch.minimum(union, ordered)
    for z in ORACLE_Z:
        out[f"{z:g}σ"] = tv_box(p, torch.minimum(z * sigma, radius), rows=numba_box.box_rows)
    out["exact"] = true_tv(torch.softmax(exact.masked_fill(~visible, ninf), -1), p)
    return out


@dataclass
class Row:
    """Every cell's value of each column ``[G, reads]`` (query heads × reads, concatenated over reads)."""

    cells: dict[str, list[torch.Tensor]]

    def stacked(self, column: str) -> torch.Tensor:
        return torch.cat(self.cells[column], 1)

    def passed(self, column: str) -> tuple[float, float]:
        """Shares of cells and of KV-head reads within τ."""
        ok = self.stacked(column) <= TAU
        return float(ok.double().mean()), float(ok.all(0).double().mean())

    def violations(self) -> int:
        exact = self.stacked("exact")
        return int(((exact > self.stacked("order-stat")) | (exact > self.stacked("uniform box"))).sum())


def measure(codec: str, seen: Captured, nq: int, tiers: Tiers | None, delta_loc: float, row: Row) -> None:
    """Add every read of ``seen`` with keys in ``codec`` (and ``tiers``) to ``row``."""
    names = (codec,) if tiers is None else (codec, tiers.codec)
    coded = [get(name) for name in names]
    sc = seen.scale
    for r, layer in coded_reads(seen, nq, names):
        g = r.q.shape[0]
        heavy = torch.zeros(r.k.shape[0], dtype=torch.bool)
        if tiers is not None:
            group = seen.qs[r.layer][r.head * g : (r.head + 1) * g]
            heavy = heavy_tokens(group, r.k, sc, seen.windows[r.layer], nq, tiers)
        khat = torch.where(heavy[:, None], layer[-1][0][r.head], r.khat)
        sig2, unif = [], []
        s = r.k.shape[0]
        for (_, steps), c in zip(layer, coded, strict=True):
            if steps is None or not c.tier_b:
                raise SystemExit(f"{c.name}: not a dithered codec, it has no Tier-B proxy")
            sig2.append(tier_b_sigma2(r.q, steps[r.head], sc, c.group_size))
            unif.append(tier_b_radius_uniform(r.q, steps[r.head], sc, s, delta_loc / 2, c.group_size))
        sigma2, uniform = torch.where(heavy, sig2[-1], sig2[0]), torch.where(heavy, unif[-1], unif[0])
        tier_a = tier_a_radius(r.q, band_norms(khat - r.k, BANDS).unsqueeze(0), sc)
        visible = r.vis.expand(g, -1, -1)
        values = cell_bounds(sc * r.q @ khat.T, sc * r.q @ r.k.T, visible, tier_a, sigma2, uniform, delta_loc)
        for column, v in values.items():
            row.cells[column].append(v)


def table(rows: dict[str, Row]) -> ReportTable:
    lines = []
    for label, row in rows.items():
        shares = [row.passed(c) for c in COLUMNS]
        lines.append(
            (
                label,
                f"{row.stacked('exact').numel():,}",
                *(f"{fmt(cell, percent=True)} / {fmt(head, percent=True)}" for cell, head in shares),
                fmt(float(row.stacked("order-stat").median()), 3),
                str(row.violations()),
            )
        )
    return ReportTable(
        f"cells / KV-head reads within τ = {TAU}",
        ("keys", "cells", *COLUMNS, "order-stat p50", "viol."),
        tuple(lines),
        "the boxes and order-stat: partially certified (queries independent of the dither; δ_loc per cell); "
        f"{', '.join(f'{z:g}σ' for z in ORACLE_Z)}: the box at those radii, an oracle, not a bound; exact: empirical.",
    )


def plot(rows: dict[str, Row], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(rows), 3.6))
    width = 0.8 / len(COLUMNS)
    for j, column in enumerate(COLUMNS):
        heads = [100 * rows[label].passed(column)[1] for label in rows]
        ax.bar([i + j * width for i in range(len(rows))], heads, width, label=column)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], list(rows), fontsize=7)
    ax.set_ylabel(f"KV-head reads within τ = {TAU} (%)")
    ax.set_ylim(0, 122)  # room for the legend above the bars
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncols=len(COLUMNS), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--codecs", default="dither-int5+bypass8", help="(light-tier) key codecs, one row each")
    ap.add_argument("--heavy", default="dither-int8+bypass8", help="heavy-tier codec, or none: no token tiers")
    ap.add_argument("--heavy-frac", type=float, default=0.2)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--corpus", default="pg-essays")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--plot", type=Path)
    ap.add_argument(
        "--delta-loc", type=float, default=None, help="the per-cell failure budget (default: the model's, as served)"
    )
    args = ap.parse_args()
    model, tok = load(args.model)
    cfg = model.config.get_text_config()
    delta_loc = args.delta_loc or ValidationConfig().delta_loc(cfg.num_hidden_layers, cfg.num_attention_heads)
    if not 0.0 < delta_loc < 1.0:
        ap.error(f"--delta-loc must lie in (0, 1), got {delta_loc}")
    tiers = None if args.heavy == "none" else Tiers(args.heavy, args.heavy_frac)
    codecs = args.codecs.split(",")
    labels = {c: c if tiers is None else tiers.label(c) for c in codecs}
    rows = {labels[c]: Row({column: [] for column in COLUMNS}) for c in codecs}
    console = Console()
    with progress_bar("samples x codecs", args.samples * len(codecs), console) as tick:
        for text in texts(args.corpus, args.samples, args.tokens, args.seed):
            seen = capture(model, tok(text, return_tensors="pt").input_ids[:, : args.tokens])
            for c in codecs:
                measure(c, seen, args.queries, tiers, delta_loc, rows[labels[c]])
                tick(1)
    title = (
        f"{args.model}, {args.corpus}, samples={args.samples} tokens={args.tokens} queries={args.queries} "
        f"seed={args.seed}, δ_loc={delta_loc:.3g}"
    )
    console.print(title, highlight=False)
    print_table(console, table(rows))
    if args.plot:
        plot(rows, args.plot, title)
        console.print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
