"""Can a witness of a whole page of key residuals beat the per-token box? Per real attention cell, the box supremum
over the Tier-A radii (``docs/math.md#box-supremum``, what the gate reads) beside the **page-spectral p-weighted
form** (``docs/math.md#page-spectral-form``): the p-weighted TV form with the served ``p̃`` as its base, the logit
errors of each page of ``--page`` tokens bounded together through the spectral norm of the page's residual matrix
(per band of RoPE pairs), and the tokens a page's weight concentrates on still bounded one by one.

The spectral norms here are the eigen-solver's, with no rounding allowance, so every number of the form is
*optimistic* for a stored witness (a sound one, :func:`kvcert.bounds.spectral.spectral_norm_up`, can only be larger).
Every cell is still checked against the exact TV (violations must be 0: the form's inequalities hold at the exact
norms). The question is only whether the form would ever beat the box enough to build it.

Per sample: ``--tokens`` tokens of a corpus at a seeded offset, one forward recording every layer's post-RoPE
queries and keys (``benchmarks/witness_tightness.py``'s capture), then each of the last ``--queries`` positions read
over its causal prefix (a sliding-window layer over its window), the keys served by ``--codecs``. With ``--heavy
CODEC`` the rows are token tiers (``benchmarks/tv_box_tightness.py``'s :class:`Tiers`, ``--heavy-frac`` of the
tokens of each KV head in ``CODEC``, chosen from the prefill): the form then bounds the light tokens as one atom
(``docs/math.md#light-atom``), the heavy ones through the box.

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/page_spectral_form.py [--model smollm2-135m]
[--samples 1] [--tokens 2048] [--queries 4] [--seed 1] [--codecs int4,dither-int5] [--pages 16,64,256]
[--bands 1,8] [--heavy dither-int8 --heavy-frac 0.2] [--plot FILE]``. Tiers: box certified (Tier A, any query); the
form an optimistic estimate of a certified bound (above); exact TV empirical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert.bounds import band_norms, tier_a_radius, true_tv, tv_box  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.kernels import numba_box  # noqa: E402
from kvcert.models.zoo import load  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402
from tv_box_tightness import BANDS, TAU, Tiers, heavy_tokens  # noqa: E402
from witness_tightness import Candidate, Captured, capture, encoded, head_reads, texts  # noqa: E402


def band_columns(d: int, bands: int) -> list[torch.Tensor]:
    """The coordinates of each band of ``bands`` contiguous groups of RoPE pairs ``(j, j + d/2)`` (the grouping of
    :func:`kvcert.bounds.band_norms` with ``rotate_half`` pairing)."""
    half = d // 2
    if bands < 1 or half % bands:
        raise ValueError(f"d/2 = {half} rotary pairs cannot be split into {bands} equal bands")
    w = half // bands
    return [
        torch.cat([torch.arange(b * w, (b + 1) * w), torch.arange(half + b * w, half + (b + 1) * w)])
        for b in range(bands)
    ]


def page_spectra(residual: torch.Tensor, page: int, bands: int) -> torch.Tensor:
    """``[pages, bands]``: the spectral norm of each band's columns of each page of ``page`` consecutive rows of
    ``residual[S, D]`` (the last page padded with zero rows), float64, from the eigen-solver."""
    s, d = residual.shape
    n = -(-s // page)
    rows = torch.cat([residual, residual.new_zeros(n * page - s, d)]).view(n, page, d).to(torch.float64)
    return torch.stack([torch.linalg.matrix_norm(rows[..., cols], ord=2) for cols in band_columns(d, bands)], -1)


def _growth(c: torch.Tensor) -> torch.Tensor:
    """``g(c) = (e^c − 1 − c)/c²`` (``½`` at 0): non-decreasing, and ``e^x − 1 ≤ x + g(c)·x²`` for ``0 ≤ x ≤ c``."""
    small = c < 1e-4
    safe = torch.where(small, torch.ones_like(c), c)
    return torch.where(small, 0.5 + c / 6, (torch.expm1(safe) - safe) / (safe * safe))


def sided_sum(a: torch.Tensor, c: torch.Tensor, e: torch.Tensor, page: int, up: bool) -> torch.Tensor:
    """An upper bound on ``Σ_t a_t (e^{x_t} − 1)⁺`` (``up``) or ``Σ_t a_t (1 − e^{x_t})⁺`` over every ``x`` with
    ``|x_t| ≤ c_t`` and ``‖x_P‖₂ ≤ e_P`` on each page ``P`` of ``page`` consecutive tokens. ``a``, ``c``: ``[..., S]``
    (``a ≥ 0``); ``e``: ``[..., pages]``.

    Per page, for any set ``T`` of its tokens: ``Σ_{t∈T} a_t h(c_t) + ‖a_{P∖T}‖₂·e_P + max_{P∖T}(a_t g(c_t))·e_P²``
    (up: ``h(c) = e^c − 1``, ``e^x − 1 ≤ x + g(c)x²`` on ``[0, c]``, Cauchy–Schwarz on the linear part, the largest
    coefficient on the quadratic; down: ``h(c) = min(1, c)``, ``1 − e^x ≤ −x``, no quadratic part). ``T`` ranges over
    the page's ``j`` largest ``a_t``, ``j = 0 … page``, and the least value is kept."""
    s, n = a.shape[-1], e.shape[-1]
    pad = (0, n * page - s)
    a = torch.nn.functional.pad(a, pad).unflatten(-1, (n, page))
    c = torch.nn.functional.pad(c, pad).unflatten(-1, (n, page))
    own = a * (torch.expm1(c) if up else c.clamp(max=1.0))
    quad = a * _growth(c) if up else torch.zeros_like(a)
    order = a.argsort(-1, descending=True)
    a, own, quad = a.gather(-1, order), own.gather(-1, order), quad.gather(-1, order)
    zero = torch.zeros_like(a[..., :1])
    alone = torch.cat([zero, own.cumsum(-1)], -1)  # T = the j largest, j = 0 … page
    rest_norm = torch.cat([(a * a).flip(-1).cumsum(-1).flip(-1), zero], -1).sqrt()
    rest_quad = torch.cat([quad.flip(-1).cummax(-1).values.flip(-1), zero], -1)
    e = e.unsqueeze(-1)
    return (alone + rest_norm * e + rest_quad * e * e).amin(-1).sum(-1)


def spectral_form(
    p: torch.Tensor, c: torch.Tensor, e: torch.Tensor, page: int, light: torch.Tensor | None = None
) -> torch.Tensor:
    """The page-spectral p-weighted bound on ``TV(p, p̃)`` (``docs/math.md#page-spectral-form``), ``p̃ = p[..., S]``
    the served attention, ``c`` the per-token radii, ``e`` the page bounds on ``‖x_P‖₂`` (``x = s − s̃``).

    Without ``light``: ``max(U, D)`` with ``U``, ``D`` the :func:`sided_sum` bounds over every token, weights ``p̃``.
    With ``light`` (``[S]`` or ``[..., S]`` bool): the light-atom form, ``tv_box`` over the other tokens' radii and
    the light atom's ``max(log(1 + U_π), −log(1 − D_π))``, plus ``M̃_L·max(U_π, D_π)``, the sums weighted by the
    served attention within the light set ``π̃``. Clipped at 1."""
    if light is None:
        up, down = sided_sum(p, c, e, page, True), sided_sum(p, c, e, page, False)
        return torch.maximum(up, down).clamp(max=1.0)
    light = light.expand_as(p)
    mass = p.masked_fill(~light, 0.0).sum(-1)
    pi = p.masked_fill(~light, 0.0) / mass.unsqueeze(-1).clamp(min=1e-300)
    c_light = c.masked_fill(~light, 0.0)
    up, down = sided_sum(pi, c_light, e, page, True), sided_sum(pi, c_light, e, page, False)
    atom = torch.maximum(torch.log1p(up), -torch.log1p(-down.clamp(max=1.0)))  # +inf when down reaches 1
    atom = torch.minimum(atom, c_light.amax(-1))  # the atom's error is at most its largest token's
    coarse = tv_box(
        torch.cat([p.masked_fill(light, 0.0), mass.unsqueeze(-1)], -1),
        torch.cat([c.masked_fill(light, 0.0), atom.unsqueeze(-1)], -1),
        rows=numba_box.box_rows,
    )
    return (coarse + mass * torch.maximum(up, down).clamp(max=1.0)).clamp(max=1.0)


def page_weight(p: torch.Tensor, e: torch.Tensor, page: int) -> torch.Tensor:
    """``Σ_P ‖p̃_P‖₂·e_P``: the first-order term of the form with no token taken alone (``p[..., S]``,
    ``e[..., pages]``), to set beside the per-token ``Σ_t p̃_t c_t`` and the exact ``Σ_t p̃_t |x_t|``."""
    n = e.shape[-1]
    pages = torch.nn.functional.pad(p, (0, n * page - p.shape[-1])).unflatten(-1, (n, page))
    return (pages.norm(dim=-1) * e).sum(-1)


def cells(
    codec: str, seen: Captured, nq: int, pages: list[int], bands: list[int], tiers: Tiers | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per row name (``exact TV``, ``box``, ``page P, B bands`` and ``best``, the least of the box and every form):
    every cell's value and, per KV-head read, whether every query head of the read is ``<= τ``. Also the first-order
    terms, per cell (names starting ``linear:``): the exact ``Σ_t p̃_t |x_t|``, the per-token ``Σ_t p̃_t c_t`` and
    each page form's :func:`page_weight`."""
    names = (codec,) if tiers is None else (codec, tiers.codec)
    layer: list[torch.Tensor] = []
    out: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def serve(k: torch.Tensor) -> torch.Tensor:
        layer[:] = [encoded(Candidate(name, name, {}), k)[0] for name in names]
        return layer[0]

    def add(name: str, value: torch.Tensor) -> None:
        values, reads = out.setdefault(name, ([], []))
        values.append(value.flatten())
        reads.append((value <= TAU).all(0))

    sc = seen.scale
    for r in head_reads(seen, nq, serve):
        khat, light, heavy = r.khat, None, torch.zeros(r.k.shape[0], dtype=torch.bool)
        if tiers is not None:
            g = r.q.shape[0]
            heavy = heavy_tokens(
                seen.qs[r.layer][r.head * g : (r.head + 1) * g], r.k, sc, seen.windows[r.layer], nq, tiers
            )
            khat, light = torch.where(heavy[:, None], layer[1][r.head], khat), r.vis & ~heavy
        residual = khat - r.k
        c = tier_a_radius(r.q, band_norms(residual, BANDS).unsqueeze(0), sc).masked_fill(~r.vis, 0.0)
        p = torch.softmax((sc * r.q @ khat.T).masked_fill(~r.vis, float("-inf")), -1)
        exact = torch.softmax((sc * r.q @ r.k.T).masked_fill(~r.vis, float("-inf")), -1)
        box = tv_box(p, c, rows=numba_box.box_rows)
        add("exact TV", true_tv(exact, p))
        add("box", box)
        add("linear: exact Σ p̃|x|", (p * sc * (r.q @ residual.T).abs()).sum(-1))
        add("linear: per token Σ p̃ c", (p * c).sum(-1))
        best, best_form = box, torch.ones_like(box)
        witnessed = residual.masked_fill(heavy[:, None], 0.0)  # the light tokens' pages (every token without tiers)
        for page in pages:
            for b in bands:
                e = sc * band_norms(r.q, b) @ page_spectra(witnessed, page, b).T  # [G, nq, pages]
                form = spectral_form(p, c, e, page, light)
                name = f"page {page}, {b} band{'s' if b > 1 else ''}"
                add(name, form)
                add(f"linear: {name}, Σ ‖p̃_P‖ e_P", page_weight(p, e, page))
                best, best_form = torch.minimum(best, form), torch.minimum(best_form, form)
        add("best page form", best_form)
        add("best of box and forms", best)
    return {name: (torch.cat(v), torch.cat(k)) for name, (v, k) in out.items()}


def keys_label(codec: str, tiers: Tiers | None) -> str:
    """``codec``, or with token tiers ``codec + 20% heavy-codec``."""
    return codec if tiers is None else tiers.label(codec)


def table(codec: str, rows: dict[str, tuple[torch.Tensor, torch.Tensor]], tiers: Tiers | None) -> ReportTable:
    """One line per bound: cells, violations (below the exact TV), median, share of cells and of KV-head reads
    at or below τ."""
    tv = rows["exact TV"][0]
    lines = []
    for name, (value, reads) in rows.items():
        if name.startswith("linear:"):
            continue
        viol = "–" if name == "exact TV" else str(int((value < tv - 1e-12).sum()))
        lines.append(
            (
                name,
                f"{value.numel():,}",
                viol,
                fmt(float(value.median())),
                fmt(float((value <= TAU).double().mean()), percent=True),
                fmt(float(reads.double().mean()), percent=True),
            )
        )
    return ReportTable(
        f"keys {keys_label(codec, tiers)}: the box against the page-spectral p-weighted form",
        ("bound", "cells", "violations", "median", f"cells <= {TAU}", f"KV-head reads <= {TAU}"),
        tuple(lines),
        "box: certified (Tier A); page rows: optimistic estimates of a certified bound (eigen-solver spectral norms, "
        "no rounding allowance); exact TV: empirical. violations = cells below the exact TV (must be 0).",
    )


def linear_table(codec: str, rows: dict[str, tuple[torch.Tensor, torch.Tensor]], tiers: Tiers | None) -> ReportTable:
    """The first-order terms (``linear:`` rows): median, p10 and p90 over cells (every token of a read, heavy or
    light)."""
    lines = []
    for name, (value, _) in rows.items():
        if name.startswith("linear: "):
            q = torch.quantile(value, torch.tensor([0.5, 0.1, 0.9], dtype=value.dtype)).tolist()
            lines.append((name.removeprefix("linear: "), *(fmt(x) for x in q)))
    return ReportTable(
        f"keys {keys_label(codec, tiers)}: first-order terms over every token (why the form loses or wins)",
        ("term", "median", "p10", "p90"),
        tuple(lines),
        "x = s − s̃ (the logit errors); c: per-token Tier-A radii; e_P: the page bound on ‖x_P‖₂. Exact term "
        "empirical, the others as the bound rows above.",
    )


def plot(results: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]], path: Path, title: str) -> None:
    """One panel per codec: the share of cells whose exact TV, box, best page form, and least of both are at or
    below τ, for τ in [0, 1]."""
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False, sharey=True)
    taus = torch.linspace(0, 1, 201, dtype=torch.float64)
    for ax, (label, rows) in zip(axes[0], results.items(), strict=True):
        for name, style in (("exact TV", ":"), ("box", "-"), ("best page form", "--"), ("best of box and forms", "-.")):
            v = rows[name][0].to(torch.float64)
            ax.plot(taus.numpy(), (v[None, :] <= taus[:, None]).double().mean(-1).numpy(), style, label=name, lw=1.3)
        ax.axvline(TAU, color="grey", lw=0.8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("τ (bound on TV)")
    axes[0][0].set_ylabel("share of cells with bound ≤ τ")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--corpus", default="pg-essays")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--codecs", default="int4,dither-int5")
    ap.add_argument("--pages", default="16,64,256")
    ap.add_argument("--bands", default="1,8")
    ap.add_argument("--heavy", default=None, help="heavy-tier codec: the rows become token tiers")
    ap.add_argument("--heavy-frac", type=float, default=0.2)
    ap.add_argument("--plot", type=Path, default=None, help="PNG: the share of cells at or below τ, per codec")
    args = ap.parse_args()
    pages, bands = [int(x) for x in args.pages.split(",")], [int(x) for x in args.bands.split(",")]
    tiers = None if args.heavy is None else Tiers(args.heavy, args.heavy_frac)
    model, tok = load(args.model)
    console = Console()
    codecs = args.codecs.split(",")
    merged: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {c: {} for c in codecs}
    with progress_bar("samples x codecs", args.samples * len(codecs), console) as advance:
        for text in texts(args.corpus, args.samples, args.tokens, args.seed):
            seen = capture(model, tok(text, return_tensors="pt").input_ids[:, : args.tokens])
            for codec in codecs:
                for name, (v, k) in cells(codec, seen, args.queries, pages, bands, tiers).items():
                    old = merged[codec].get(name)
                    merged[codec][name] = (v, k) if old is None else (torch.cat([old[0], v]), torch.cat([old[1], k]))
                advance(1)
    for codec in codecs:
        print_table(console, table(codec, merged[codec], tiers))
        print_table(console, linear_table(codec, merged[codec], tiers))
    if args.plot is not None:
        labelled = {keys_label(codec, tiers): merged[codec] for codec in codecs}
        plot(labelled, args.plot, f"{args.model}: box against the page-spectral form (optimistic), per cell")


if __name__ == "__main__":
    main()
