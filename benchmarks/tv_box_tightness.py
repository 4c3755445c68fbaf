"""How much tighter is the box supremum than the meter, on real attention cells? Per key codec, the Tier-A cell
certificate of a real model (``--model``, SmolLM2-135M by default) read two ways from the same radii: the meter
(``min(1, eform, two_sided, ptm)``, what the gate reads today) and :func:`kvcert.bounds.tv_box`
(``docs/math.md#box-supremum``: up to its grid, the least bound any form can derive from ``p̃`` and the radii
alone), taken as ``min(meter, box)``.

Per sample: ``--tokens`` tokens of a corpus at a seeded offset, one forward recording the post-RoPE queries and keys
of every layer (``benchmarks/witness_tightness.py``'s capture); then per (layer, query head) and each of the last
``--queries`` positions, a decode-like read over the whole causal prefix with the codec's served keys: ``p̃``, the
Tier-A radii of the residual's 8 RoPE band norms (what the store keeps) and the exact TV against the unquantised keys.
A sliding-window layer (Gemma-3) reads only its window, as the model does.

Columns per codec: cells; violations (cells whose exact TV exceeds ``min(meter, box)``; must be 0); the medians of
both certificates and of ``box / meter``; the share of cells each certifies at τ = 0.2 (the cells a
``Gate.certified(0.2)`` passes without repair); the informative fraction (unclipped meter < 1, unchanged by the
box); the median exact TV; the CPU time per cell of each form, side by side, the box both as tensor operations and
compiled (:func:`kvcert.kernels.numba_box.box_rows`), with the largest relative difference of the two. A second
table gives what a head gate at τ passes (Tier A, and with ``--tier-b`` the box over ``min(Tier A, Tier B)``); a third
what no sound certificate can beat: the share of KV-head reads whose exact TV is ``<= τ`` and the p-weighted form at
the draw's own errors (``docs/math.md#p-weighted-form``). With ``--plot``, the distribution of both certificates per
codec (ECDF, τ marked).

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tv_box_tightness.py [--model smollm2-135m]
[--samples 2] [--tokens 2048] [--queries 8] [--corpus pg-essays] [--seed 1] [--codecs int8,fp8-e4m3,int4,hadamard-int4]
[--intervals 16] [--plot FILE] [--plot-ceiling FILE] [--tier-b]``. Tiers: both certificates certified (Tier A, any
query); the min(A, B) box partially certified; exact TV and the oracle ceilings empirical.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert import ValidationConfig  # noqa: E402
from kvcert.bounds import (  # noqa: E402
    band_norms,
    meter_and_unclipped,
    tier_a_radius,
    tier_b_radius,
    tier_b_sigma2,
    true_tv,
    tv_box,
)
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.kernels import numba_box  # noqa: E402
from kvcert.models.zoo import load  # noqa: E402
from kvcert.quant import bytes_per_token_head, get  # noqa: E402
from kvcert.report import figures  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402
from witness_tightness import Candidate, Captured, capture, encoded, head_reads, texts  # noqa: E402

TAU = 0.2
BANDS = 8


def p_weighted_form(exact: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``½(M + |Σ_t p_t (e^{ε_t} − 1)|)`` with ``M = Σ_t p_t |e^{ε_t} − 1|``: the p-weighted TV form at the draw's
    own logit errors ``ε = s̃ − s`` and the exact ``p`` (``docs/math.md#p-weighted-form``). An upper bound on
    ``TV(p, p̃)`` for every ``ε``; a Tier-B bound built on it bounds both sums from above with high probability, so
    it is above this value except on its failure event: an oracle ceiling of that family, not a certificate."""
    excess = exact * torch.expm1(eps)
    return 0.5 * (excess.abs().sum(-1) + excess.sum(-1).abs())


def cells(
    codec: str, seen: Captured, nq: int, intervals: int, delta_loc: float | None = None
) -> dict[str, torch.Tensor]:
    """Per cell of every layer and query head: exact TV, the meter (clipped, unclipped) and ``min(meter, box)``; and
    the seconds spent in the meter, in ``tv_box`` and in its compiled evaluation (one thread's clock, side by side on
    the same cells), and each cell's relative difference of the two evaluations (``gap``). ``kv_box``: per KV-head
    read (a decode step of one KV head), whether every query head's box is ``<= τ`` (what a head gate passes).
    A layer with a sliding window (``seen.windows``) reads only its window.

    With ``delta_loc`` and a dithered codec, also ``partial`` (and ``kv_partial``): ``min(meter, box)`` over the radii
    ``min(c_t, u_t)``, ``u_t`` the Tier-B union radius at ``delta_loc`` (``docs/math.md#tier-b-radius``): partially
    certified (non-adaptive queries; it fails with probability at most ``delta_loc`` per cell)."""
    tv, meter, raw, box, gap, kv_box, kv_exact, pweighted, heaviest, partial, kv_partial = ([] for _ in range(11))
    spent = torch.zeros(3, dtype=torch.float64)
    cand = Candidate(codec, codec, {})
    codec_obj = get(codec)
    tier_b = delta_loc is not None and codec_obj.tier_b
    group_size = getattr(codec_obj, "group_size", 0)
    layer_steps: list[torch.Tensor | None] = [None]

    def serve(k: torch.Tensor) -> torch.Tensor:  # one call per layer, before its heads' reads
        khat, layer_steps[0] = encoded(cand, k)
        return khat

    sc = seen.scale
    for r in head_reads(seen, nq, serve):
        vis, qq = r.vis, r.q
        c = tier_a_radius(qq, band_norms(r.khat - r.k, BANDS).unsqueeze(0), sc).masked_fill(~vis, 0.0)
        served_logit, exact_logit = sc * qq @ r.khat.T, sc * qq @ r.k.T
        p = torch.softmax(served_logit.masked_fill(~vis, float("-inf")), -1)
        exact = torch.softmax(exact_logit.masked_fill(~vis, float("-inf")), -1)
        t0 = time.thread_time()
        m, m_raw = meter_and_unclipped(p, c)
        t1 = time.thread_time()
        b = tv_box(p, c, intervals=intervals)
        t2 = time.thread_time()
        b_compiled = tv_box(p, c, intervals=intervals, rows=numba_box.box_rows)
        spent += torch.tensor([t1 - t0, t2 - t1, time.thread_time() - t2], dtype=torch.float64)
        gap.append(((b_compiled - b).abs() / b.clamp(min=1e-12)).flatten())
        cell_tv = true_tv(exact, p)  # [G, nq]
        tv.append(cell_tv.flatten())
        kv_exact.append((cell_tv <= TAU).all(0))
        pweighted.append(p_weighted_form(exact, (served_logit - exact_logit).masked_fill(~vis, 0.0)).flatten())
        heaviest.append(exact.amax(-1).flatten())
        meter.append(m.flatten())
        raw.append(m_raw.flatten())
        cell_box = torch.minimum(m, b)  # [G, nq]
        box.append(cell_box.flatten())
        kv_box.append((cell_box <= TAU).all(0))
        if tier_b:
            steps = layer_steps[0]
            assert steps is not None  # a dithered codec stores its steps
            u = tier_b_radius(tier_b_sigma2(qq, steps[r.head], sc, group_size), r.k.shape[0], delta_loc)
            cp = torch.minimum(c, u).masked_fill(~vis, 0.0)
            cell_partial = torch.minimum(meter_and_unclipped(p, cp)[0], tv_box(p, cp, rows=numba_box.box_rows))
            partial.append(cell_partial.flatten())
            kv_partial.append((cell_partial <= TAU).all(0))
    named = (
        ("tv", tv),
        ("meter", meter),
        ("raw", raw),
        ("box", box),
        ("gap", gap),
        ("kv_box", kv_box),
        ("kv_exact", kv_exact),
        ("pweighted", pweighted),
        ("heaviest", heaviest),
    )
    out = {name: torch.cat(x) for name, x in named}
    if tier_b:
        out |= {"partial": torch.cat(partial), "kv_partial": torch.cat(kv_partial)}
    return {**out, "spent": spent}


def table(results: dict[str, dict[str, torch.Tensor]], intervals: int, model: str = "smollm2-135m") -> ReportTable:
    rows = []
    for codec, r in results.items():
        share = lambda x: float((x <= TAU).double().mean())  # noqa: E731
        rows.append(
            (
                codec,
                fmt(r["tv"].numel()),
                fmt(int((r["tv"] > r["box"]).sum())),
                fmt(float(r["meter"].median())),
                fmt(float(r["box"].median())),
                fmt(float((r["box"] / r["meter"].clamp(min=1e-300)).median())),
                fmt(share(r["meter"]), percent=True),
                fmt(share(r["box"]), percent=True),
                fmt(float((r["raw"] < 1).double().mean()), percent=True),
                fmt(float(r["tv"].median())),
                fmt(1e3 * float(r["spent"][0]) / r["tv"].numel()),
                fmt(1e3 * float(r["spent"][1]) / r["tv"].numel()),
                fmt(1e3 * float(r["spent"][2]) / r["tv"].numel()),
                fmt(float(r["gap"].max())),
            )
        )
    return ReportTable(
        f"Tier-A cell certificates on {model}: the meter and the box supremum ({intervals} intervals, heaviest token "
        "exact)",
        (
            "key codec",
            "cells",
            "violations",
            "median meter",
            "median box",
            "median box/meter",
            f"meter <= {TAU}",
            f"box <= {TAU}",
            "informative",
            "median exact TV",
            "meter ms/cell",
            "box ms/cell",
            "compiled box ms/cell",
            "max rel. diff compiled",
        ),
        tuple(rows),
        "box = min(meter, tv_box); violations = cells whose exact TV exceeds it (must be 0); <= τ = cells a "
        "certified(0.2) gate passes without repair; informative = unclipped meter < 1; ms/cell = CPU time of one "
        "thread per cell, the forms timed side by side on the same cells (box: the tensor evaluation; compiled box: "
        "kvcert.kernels.numba_box, the same bound up to summation order, its largest relative difference beside it). "
        "Tiers: certificates certified (Tier A, "
        "any query); exact TV empirical; times measured.",
    )


def gate_table(results: dict[str, dict[str, torch.Tensor]], delta_loc: float | None, model: str) -> ReportTable:
    """Per codec, what a head gate at τ sees: the share of KV-head reads whose every query head's box is ``<= τ``,
    with the Tier-A radii and (``--tier-b``, dithered codecs) with ``min(Tier A, Tier B)``."""
    rows = []
    for codec, r in results.items():
        partial = r.get("partial")
        rows.append(
            (
                codec,
                fmt(r["kv_box"].numel()),
                fmt(float(r["kv_box"].double().mean()), percent=True),
                *(
                    ("–",) * 4
                    if partial is None
                    else (
                        fmt(float(partial.median())),
                        fmt(float((partial <= TAU).double().mean()), percent=True),
                        fmt(float(r["kv_partial"].double().mean()), percent=True),
                        fmt(int((r["tv"] > partial).sum())),
                    )
                ),
            )
        )
    delta = "no Tier B" if delta_loc is None else f"δ_loc = {delta_loc:.3g}"
    return ReportTable(
        f"What a head gate at τ = {TAU} passes on {model}: Tier A, and min(Tier A, Tier B) ({delta})",
        (
            "key codec",
            "KV-head reads",
            f"Tier A: KV heads <= {TAU}",
            "min(A, B): median box",
            f"min(A, B): cells <= {TAU}",
            f"min(A, B): KV heads <= {TAU}",
            "min(A, B): violations",
        ),
        tuple(rows),
        "KV-head read = one decode step of one KV head; it passes when the box of every query head it serves is <= τ. "
        "min(A, B) = the box over the radii min(Tier A, Tier-B union radius at δ_loc, the library's default split of "
        "δ_req = 1e-2): partially certified (subtractive dither, non-adaptive queries; each cell fails with "
        "probability at most δ_loc); violations = cells whose exact TV exceeds it. Tiers: Tier A certified, "
        "min(A, B) partially certified, exact TV empirical.",
    )


def ceiling_table(results: dict[str, dict[str, torch.Tensor]], model: str) -> ReportTable:
    """Per codec, what no sound certificate can beat: a sound bound is at least the exact TV (Tier B: except on its
    failure event), so a head gate at τ passes at most the KV-head reads whose exact TV is ``<= τ`` on every query
    head; and the p-weighted form at the draw's own errors (:func:`p_weighted_form`)."""
    rows = []
    for codec, r in results.items():
        tv, pw = r["tv"], r["pweighted"]
        rows.append(
            (
                codec,
                fmt(tv.numel()),
                fmt(float(tv.median())),
                fmt(float(tv.quantile(0.9))),
                fmt(float(r["heaviest"].median())),
                fmt(float((tv <= TAU).double().mean()), percent=True),
                fmt(float(r["kv_exact"].double().mean()), percent=True),
                fmt(float((pw < 1).double().mean()), percent=True),
                fmt(float((pw <= TAU).double().mean()), percent=True),
                fmt(int((tv > pw).sum())),
            )
        )
    return ReportTable(
        f"What no sound certificate can beat on {model}: the exact TV, and the p-weighted form at the draw's errors",
        (
            "key codec",
            "cells",
            "median exact TV",
            "p90 exact TV",
            "median heaviest p_t",
            f"cells: exact TV <= {TAU}",
            f"KV-head reads: exact TV <= {TAU}",
            "p-weighted form < 1",
            f"p-weighted form <= {TAU}",
            "p-weighted form: violations",
        ),
        tuple(rows),
        f"KV-head reads with exact TV <= {TAU} on every query head = the most a head gate at τ over any sound "
        "bound can pass. heaviest p_t = the largest exact attention weight of a cell. p-weighted form = "
        "½(Σ_t p_t |e^{ε_t} − 1| + |Σ_t p_t (e^{ε_t} − 1)|) with the exact p and this draw's logit errors "
        "(docs/math.md#p-weighted-form): what a Tier-B bound of that form could reach at best; violations = cells "
        "whose exact TV exceeds it (must be 0: the inequality holds for every ε). Tiers: all empirical (oracle "
        "quantities, not certificates).",
    )


def plot(results: dict[str, dict[str, torch.Tensor]], path: Path, model: str = "smollm2-135m") -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (codec, r) in enumerate(results.items()):
        color = f"C{i}"
        for key, style, label in (("meter", "--", "meter"), ("box", "-", "box"), ("partial", ":", "box, min(A, B)")):
            if key not in r:
                continue
            x = r[key].sort().values.clamp(min=1e-6).numpy()
            ax.step(x, torch.linspace(0, 1, len(x)).numpy(), style, color=color, label=f"{codec}: {label}", lw=1.2)
    ax.axvline(TAU, color="grey", lw=0.8)
    ax.text(TAU, 0.02, " τ = 0.2", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(1e-4, 1.0)
    ax.set_xlabel("cell certificate (bound on TV, clipped at 1)")
    ax.set_ylabel("share of cells at or below")
    ax.set_title(f"{model}: meter (dashed), box (solid), box over min(Tier A, Tier B) (dotted)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_ceiling(results: dict[str, dict[str, torch.Tensor]], head_dim: int, path: Path, model: str) -> None:
    """Per codec (rows by stored bytes): the share of KV-head reads a head gate at τ passes over Tier A, over
    min(Tier A, Tier B), and the most any sound gate could pass (exact TV ``<= τ`` on every query head)."""
    size = {c: bytes_per_token_head(get(c), head_dim) for c in results}
    series = {
        f"exact TV <= {TAU} (no sound gate passes more; measured)": {
            c: float(r["kv_exact"].double().mean()) for c, r in results.items()
        },
        f"box over min(Tier A, Tier B) <= {TAU} (partially certified)": {
            c: float(r["kv_partial"].double().mean()) for c, r in results.items() if "kv_partial" in r
        },
        f"box over Tier A <= {TAU} (certified)": {c: float(r["kv_box"].double().mean()) for c, r in results.items()},
    }
    title = f"{model}: KV-head reads a head gate at τ = {TAU} passes"
    figures.codec_shares(size, series, path, title, xlabel="share of KV-head reads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name of the model (offline weights)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=8, help="last positions of each sample read as decode steps")
    ap.add_argument("--corpus", default="pg-essays")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--codecs", default="int8,fp8-e4m3,int4,hadamard-int4")
    ap.add_argument("--intervals", type=int, default=16, help="tv_box's geometric intervals of [B₋, A]")
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    ap.add_argument(
        "--plot-ceiling", type=Path, default=None, help="write the KV-head pass rates against their ceiling here (PNG)"
    )
    ap.add_argument(
        "--tier-b",
        action="store_true",
        help="dithered codecs: also the box over min(Tier A, Tier B) radii (partially certified)",
    )
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    for name in codecs:
        get(name)  # an unknown codec fails here, before the model loads
    model, tok = load(args.model)
    cfg = model.config
    delta_loc = ValidationConfig().delta_loc(cfg.num_hidden_layers, cfg.num_attention_heads) if args.tier_b else None
    parts: dict[str, list[dict[str, torch.Tensor]]] = {c: [] for c in codecs}
    console = Console()
    with progress_bar("samples x codecs", args.samples * len(codecs), console) as tick:
        for text in texts(args.corpus, args.samples, args.tokens, args.seed):
            ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
            seen = capture(model, ids)
            for codec in codecs:
                parts[codec].append(cells(codec, seen, args.queries, args.intervals, delta_loc))
                tick(1)
    results = {
        c: {k: torch.stack([p[k] for p in ps]).sum(0) if k == "spent" else torch.cat([p[k] for p in ps]) for k in ps[0]}
        for c, ps in parts.items()
    }
    console.print(
        f"{args.model}, {args.corpus}, samples={args.samples} tokens={args.tokens} queries/sample={args.queries} "
        f"seed={args.seed}",
        highlight=False,
    )
    print_table(console, table(results, args.intervals, args.model))
    print_table(console, gate_table(results, delta_loc, args.model))
    print_table(console, ceiling_table(results, args.model))
    if args.plot is not None:
        plot(results, args.plot, args.model)
        console.print(f"figure: {args.plot}", highlight=False)
    if args.plot_ceiling is not None:
        plot_ceiling(results, seen.qs[0].shape[-1], args.plot_ceiling, args.model)
        console.print(f"figure: {args.plot_ceiling}", highlight=False)
    if any(
        int((r["tv"] > r["box"]).sum())
        + int((r["tv"] > r.get("partial", r["box"])).sum())
        + int((r["tv"] > r["pweighted"]).sum())
        for r in results.values()
    ):
        raise SystemExit("VIOLATIONS FOUND")


if __name__ == "__main__":
    main()
