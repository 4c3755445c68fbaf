"""If token tiers were served with a token-granular gate, how much would a request page in? Per real KV-head read with
token tiers (``benchmarks/tv_box_tightness.py``'s :class:`Tiers`: ``--heavy-frac`` of each KV head's tokens, those the
prefill attends to most, in ``--heavy``; the rest in ``--codecs``), a gate at τ = 0.2 that passes the read when every
query head's box is within τ and otherwise pages in the light tokens that weigh most in the box, a few at a time,
until it does.

The repair is greedy and token-granular: tokens ranked once per read by ``max over query heads of p̃_t(e^{c_t} − 1)``
(their share of the box's first-order term), the ``k`` first paged in for ``k`` = 0, 1, 2, 4, …; a paged-in token is
served exact (its logit exact, its radius 0) and the box is taken again over the new served attention. The first
``k`` on that ladder that passes is recorded, so the count is at most twice the least count this ranking needs. Radii:
the Tier-A band radii (certified, any query) or, with ``--tier-b``, ``min(Tier A, Tier B)`` at the model's default
``δ_loc`` (partially certified).

Page-in per decode step: each (layer, KV head) is read once per step, so the mean over reads of the paged share of a
head's visible tokens is the share of the request's fp16 K/V paged in per step; a transient repair pays it again at
every step. Everything measured here is empirical; no model is decoded (the reads are the last ``--queries`` positions
of a text, as in ``tv_box_tightness.py``).

With ``--promote`` the repair is persistent instead: a failing read moves the light tokens it needs to the heavy tier
for good (their keys re-encoded from the exact copy, so each promoted token's fp16 key is paged in once), the reads
are taken in decode order so a later read starts from the tiers the earlier ones left, and the least count that
passes on the ranking is found by bisection below the first passing :data:`LADDER` count. It reports the share of
tokens promoted after the first read and after all of them, the key bytes this adds and the page-in over the request
(``--plot``: the promoted share per read). ``--uniform`` takes Tier B from the uniform law, as the Tier-B gate serves
it (``docs/math.md#tier-b-uniform``).

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tier_repair_pagein.py [--model gemma3-270m]
[--codecs dither-int5+bypass8] [--heavy dither-int8+bypass8] [--heavy-frac 0.2] [--tier-b [--uniform]]
[--promote [--plot PNG]] [--samples 1] [--tokens 2048] [--queries 8] [--seed 11]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import matplotlib
import torch
from rich.console import Console

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert import ValidationConfig  # noqa: E402
from kvcert.bounds import (  # noqa: E402
    band_norms,
    tier_a_radius,
    tier_b_radius,
    tier_b_radius_uniform,
    tier_b_sigma2,
    tv_box,
)
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.kernels import numba_box  # noqa: E402
from kvcert.models.zoo import load  # noqa: E402
from kvcert.quant import bytes_per_token_head, get  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402
from tv_box_tightness import BANDS, TAU, Tiers, heavy_tokens, key_bytes  # noqa: E402
from witness_tightness import Captured, HeadRead, capture, coded_reads, texts  # noqa: E402

#: the repair counts tried, in order (a read that no count passes pages in every visible token)
LADDER = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def tokens_to_pass(
    served: torch.Tensor, exact: torch.Tensor, radius: torch.Tensor, visible: torch.Tensor, tau: float = TAU
) -> torch.Tensor:
    """``[nq]``: per read (the last dimension but one of every ``[G, nq, S]`` input: logits ``served`` and ``exact``,
    ``radius`` ``≥ |served − exact|``, ``visible``), the first count ``k`` of :data:`LADDER` whose repair (the ``k``
    visible tokens with the largest ``max_g p̃_t(e^{c_t} − 1)`` served exact, radius 0) brings every query head's
    box within ``tau``; the visible token count when none does before it runs out."""
    ninf = float("-inf")
    p = torch.softmax(served.masked_fill(~visible, ninf), -1)
    weight = (p * torch.expm1(radius)).masked_fill(~visible, -1.0).amax(0)  # [nq, S]; invisible tokens last
    order = weight.argsort(-1, descending=True)
    n_visible = visible.sum(-1).amax(0)  # [nq]
    need = n_visible.clone()
    done = torch.zeros_like(need, dtype=torch.bool)
    for k in LADDER:
        repaired = torch.zeros_like(weight, dtype=torch.bool).scatter_(-1, order[:, :k], True) & visible.any(0)
        logits = torch.where(repaired, exact, served)
        box = tv_box(
            torch.softmax(logits.masked_fill(~visible, ninf), -1),
            radius.masked_fill(repaired | ~visible, 0.0),
            rows=numba_box.box_rows,
        )
        passed = (box <= tau).all(0) & ~done
        need = torch.where(passed, torch.clamp(torch.full_like(need, k), max=n_visible), need)
        done |= passed
        if bool(done.all()) or k >= int(n_visible.max()):
            break
    return need


def light_weights(served: torch.Tensor, light: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell of logits ``served[..., S]`` with light tokens ``light`` (bool, broadcast; nothing else masked out):
    the served light mass ``M̃_L`` and the largest served weight within the light set, ``π̃_max = max_{t∈L} p̃_t / M̃_L``
    (0 for a cell without light tokens). A bound that concentrates over the light tokens pays for ``π_max``
    (``docs/math.md#light-atom``)."""
    p = torch.softmax(served, -1).masked_fill(~light, 0.0)
    mass = p.sum(-1)
    return mass, p.amax(-1) / mass.clamp(min=1e-300)


def token_radius(
    q: torch.Tensor,
    bands: torch.Tensor,
    steps: torch.Tensor | None,
    group: int,
    sc: float,
    n_tokens: int,
    delta_loc: float | None,
    uniform: bool,
) -> torch.Tensor:
    """``c[..., S]``: the Tier-A band radius of queries ``q[..., D]`` over key residual band norms ``bands[..., S, B]``
    and, with ``delta_loc`` and a dithered codec's ``steps[..., S, D/group]``, its minimum with the Tier-B radius at
    ``δ_loc`` over ``n_tokens`` tokens: the union radius, or with ``uniform`` the uniform-law radius the Tier-B gate
    serves (``docs/math.md#tier-b-uniform``)."""
    c = tier_a_radius(q, bands, sc)
    if delta_loc is None or steps is None:
        return c
    b = (
        tier_b_radius_uniform(q, steps, sc, n_tokens, delta_loc, group)
        if uniform
        else tier_b_radius(tier_b_sigma2(q, steps, sc, group), n_tokens, delta_loc)
    )
    return torch.minimum(c, b)


def tiered_reads(
    codec: str, seen: Captured, nq: int, tiers: Tiers, delta_loc: float | None, uniform: bool
) -> Iterator[tuple[HeadRead, torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    """Every read of :func:`coded_reads` with light keys ``codec`` and heavy keys ``tiers.codec``: the read, its KV
    head's heavy tokens ``[S]`` (:func:`heavy_tokens`), the logits ``[G, nq, S]`` of every token served light and
    served heavy, and their radii (:func:`token_radius`; a token takes each from its tier)."""
    names = (codec, tiers.codec)
    coded = [get(name) for name in names]
    sc = seen.scale
    for r, layer in coded_reads(seen, nq, names):
        g = r.q.shape[0]
        heavy = heavy_tokens(seen.qs[r.layer][r.head * g : (r.head + 1) * g], r.k, sc, seen.windows[r.layer], nq, tiers)
        logits, radii = [], []
        for (khat, steps), c in zip(layer, coded, strict=True):
            logits.append(sc * r.q @ khat[r.head].T)
            bands = band_norms(khat[r.head] - r.k, BANDS).unsqueeze(0)
            tier_steps = steps[r.head] if steps is not None and c.tier_b else None
            group = getattr(c, "group_size", 0)
            radii.append(token_radius(r.q, bands, tier_steps, group, sc, r.k.shape[0], delta_loc, uniform))
        yield r, heavy, (logits[0], logits[1]), (radii[0], radii[1])


def shares(
    codec: str, seen: Captured, nq: int, tiers: Tiers, delta_loc: float | None, uniform: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV-head read (every layer, KV head and read position): the share of its visible tokens paged in; and per
    cell (:func:`light_weights`) the light mass and ``π̃_max``."""
    out, masses, peaks = [], [], []
    for r, heavy, logits, radii in tiered_reads(codec, seen, nq, tiers, delta_loc, uniform):
        radius = torch.where(heavy, radii[1], radii[0])
        visible = r.vis.expand(r.q.shape[0], -1, -1)
        served = torch.where(heavy, logits[1], logits[0])
        need = tokens_to_pass(served, seen.scale * r.q @ r.k.T, radius.masked_fill(~visible, 0.0), visible)
        out.append(need.to(torch.float64) / visible[0].sum(-1))
        mass, peak = light_weights(served.masked_fill(~visible, float("-inf")), visible & ~heavy)
        masses.append(mass.flatten())
        peaks.append(peak.flatten())
    return torch.cat(out), torch.cat(masses), torch.cat(peaks)


def promote_reads(
    served: tuple[torch.Tensor, torch.Tensor],
    radius: tuple[torch.Tensor, torch.Tensor],
    visible: torch.Tensor,
    heavy: torch.Tensor,
    tau: float = TAU,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KV head's reads in decode order, repaired by promotion: a read whose query heads' boxes are not all within
    ``tau`` moves light tokens to the heavy tier for good (their keys re-encoded from the exact copy), the ``k`` with
    the largest ``max_g p̃_t(e^{c_t} − 1)``, for the least ``k`` that passes (the :data:`LADDER` count that first
    passes, then bisection below it). ``served`` and ``radius``: the logits and radii ``[G, nq, S]`` of every token
    served light and served heavy; ``visible[G, nq, S]``; ``heavy[S]``, the tier at the start. Returns the heavy tier
    at the end ``[S]``, the tokens promoted by each read ``[nq]``, and which reads no promotion passes ``[nq]`` (bool:
    even with every visible token heavy; such a read would fall back to a transient exact page-in)."""
    ninf = float("-inf")
    tier = heavy.clone()
    nq = visible.shape[1]
    promoted, failed = torch.zeros(nq, dtype=torch.long), torch.zeros(nq, dtype=torch.bool)
    for i in range(nq):
        vis = visible[:, i]

        def box_of(on: torch.Tensor, i: int = i, vis: torch.Tensor = vis) -> tuple[bool, torch.Tensor, torch.Tensor]:
            p = torch.softmax(torch.where(on, served[1][:, i], served[0][:, i]).masked_fill(~vis, ninf), -1)
            rad = torch.where(on, radius[1][:, i], radius[0][:, i]).masked_fill(~vis, 0.0)
            return bool((tv_box(p, rad, rows=numba_box.box_rows) <= tau).all()), p, rad

        ok, p, rad = box_of(tier)
        if ok:
            continue
        movable = vis.any(0) & ~tier
        order = (p * torch.expm1(rad)).masked_fill(~movable, -1.0).amax(0).argsort(descending=True)
        n = int(movable.sum())

        def with_top(k: int, order: torch.Tensor = order, tier: torch.Tensor = tier) -> torch.Tensor:
            return tier.clone().index_fill_(0, order[:k], True)

        lo, hi = 0, n  # a failing count, and one to try
        for k in LADDER[1:]:
            if box_of(with_top(min(k, n)))[0]:
                hi = min(k, n)
                break
            lo = min(k, n)
            if k >= n:
                break
        else:
            lo = n
        if lo >= n:  # every visible token heavy and still above tau
            failed[i] = True
            hi = n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if box_of(with_top(mid))[0] else (mid, hi)
        tier = with_top(hi)
        promoted[i] = hi
    return tier, promoted, failed


def promotions(
    codec: str, seen: Captured, nq: int, tiers: Tiers, delta_loc: float | None, uniform: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head (every layer and KV head), the share of its tokens promoted by its first ``i`` reads for ``i`` = 1
    … ``nq`` (:func:`promote_reads`; ``[heads, nq]``); and per read whether it promoted anything and whether it
    failed even fully promoted (``[reads, 2]`` bool)."""
    curves, reads = [], []
    for r, heavy, logits, radii in tiered_reads(codec, seen, nq, tiers, delta_loc, uniform):
        _, promoted, failed = promote_reads(logits, radii, r.vis.expand(r.q.shape[0], -1, -1), heavy)
        curves.append(promoted.cumsum(0).to(torch.float64) / r.k.shape[0])
        reads.append(torch.stack((promoted > 0, failed), -1))
    return torch.stack(curves), torch.cat(reads)


def table(
    rows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], key_b: dict[str, float], radii: str
) -> ReportTable:
    """One line per codec row: reads, the share passing with no repair, quantiles of the share paged in, the mean
    (the share of the request's fp16 K/V paged in per decode step), and the medians of the light mass and of
    ``π̃_max`` over cells."""
    lines = []
    for label, (share, mass, peak) in rows.items():
        q = torch.quantile(share, torch.tensor([0.5, 0.9, 0.99], dtype=share.dtype)).tolist()
        lines.append(
            (
                label,
                f"{key_b[label]:.1f}",
                f"{share.numel():,}",
                fmt(float((share == 0).double().mean()), percent=True),
                *(fmt(x, 3) for x in q),
                fmt(float(share.mean()), 3),
                fmt(float(mass.median()), 3),
                fmt(float(peak.median()), 3),
            )
        )
    return ReportTable(
        f"token tiers under a token-granular gate at τ = {TAU} ({radii})",
        (
            "keys",
            "key B / token / KV head",
            "reads",
            "no repair",
            "paged p50",
            "paged p90",
            "paged p99",
            "per step",
            "light mass p50",
            "π̃_max p50",
        ),
        tuple(lines),
        "paged = share of a read's visible tokens paged in (greedy, doubling counts); per step = its mean over reads, "
        "the share of the request's fp16 K/V paged in at each decode step by transient repair; light mass and π̃_max "
        "(the largest served weight within the light tokens) per cell. All empirical.",
    )


def promotion_table(
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]],
    key_b: dict[str, float],
    extra_b: dict[str, float],
    radii: str,
) -> ReportTable:
    """One line per codec row of :func:`promotions`: reads, the share that promoted nothing, the share of a KV head's
    tokens promoted after the first read (mean) and after all of them (mean, p90 over KV heads), the key bytes per
    token and KV head before and after (each promoted token costs the heavy codec's bytes instead of the light's),
    the page-in over the request (each promoted token's fp16 key once: half its fp16 K/V) and the reads that fail
    even with every visible token heavy. ``extra_b``: per row, the heavy codec's key bytes per token and KV head less
    the light codec's."""
    lines = []
    for label, (curves, reads) in rows.items():
        first, last = curves[:, 0], curves[:, -1]
        lines.append(
            (
                label,
                f"{reads.shape[0]:,}",
                fmt(float((~reads[:, 0]).double().mean()), percent=True),
                fmt(float(first.mean()), 3),
                fmt(float(last.mean()), 3),
                fmt(float(torch.quantile(last, 0.9)), 3),
                f"{key_b[label]:.1f} → {key_b[label] + float(last.mean()) * extra_b[label]:.1f}",
                fmt(float(last.mean()) / 2, 3),
                fmt(float(reads[:, 1].double().mean()), percent=True),
            )
        )
    return ReportTable(
        f"token tiers repaired by promotion to the heavy tier at τ = {TAU} ({radii})",
        (
            "keys",
            "reads",
            "no promotion",
            "promoted, 1st read",
            "promoted, all reads",
            "p90 over KV heads",
            "key B / token / KV head",
            "page-in ×fp16 (request)",
            "fail fully promoted",
        ),
        tuple(lines),
        "promoted = share of a KV head's tokens moved from the light to the heavy tier (mean over KV heads, reads in "
        "decode order, each promotion kept); key bytes before → after; page-in = each promoted token's fp16 key once "
        "(its re-encoding source), as a share of the request's fp16 K/V; fail = reads above τ even with every visible "
        "token heavy. All empirical.",
    )


def plot_promotions(rows: dict[str, tuple[torch.Tensor, torch.Tensor]], path: Path, model: str) -> None:
    """Per row, the mean share of a KV head's tokens promoted after each read (decode order)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, (curves, _) in rows.items():
        mean = curves.mean(0).numpy()
        ax.plot(range(1, len(mean) + 1), mean, marker="o", ms=3, label=label)
    ax.set_xlabel("reads (decode steps)")
    ax.set_ylabel("share of tokens promoted (mean over KV heads)")
    ax.set_title(f"{model}: light tokens promoted to the heavy tier at τ = {TAU} (measured)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def cat(parts: list[tuple[torch.Tensor, ...]], i: int) -> torch.Tensor:
    """Entry ``i`` of every sample's :func:`shares`, concatenated."""
    return torch.cat([part[i] for part in parts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--codecs", default="dither-int5+bypass8", help="light-tier key codecs, one row each")
    ap.add_argument("--heavy", default="dither-int8+bypass8")
    ap.add_argument("--heavy-frac", type=float, default=0.2)
    ap.add_argument("--tier-b", action="store_true", help="radii min(Tier A, Tier B) at the model's δ_loc")
    ap.add_argument("--uniform", action="store_true", help="Tier B from the uniform law (the Tier-B gate's radii)")
    ap.add_argument("--promote", action="store_true", help="repair by promoting light tokens to the heavy tier")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--corpus", default="pg-essays")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--plot", type=Path, default=None, help="with --promote: PNG of the promoted share per read")
    args = ap.parse_args()
    model, tok = load(args.model)
    cfg = model.config.get_text_config()
    delta_loc = ValidationConfig().delta_loc(cfg.num_hidden_layers, cfg.num_attention_heads) if args.tier_b else None
    tiers = Tiers(args.heavy, args.heavy_frac)
    codecs = args.codecs.split(",")
    labels = {c: tiers.label(c) for c in codecs}
    parts: dict[str, list[tuple[torch.Tensor, ...]]] = {labels[c]: [] for c in codecs}
    console = Console()
    head_dim = 0
    with progress_bar("samples x codecs", args.samples * len(codecs), console) as tick:
        for text in texts(args.corpus, args.samples, args.tokens, args.seed):
            seen = capture(model, tok(text, return_tensors="pt").input_ids[:, : args.tokens])
            head_dim = seen.qs[0].shape[-1]
            for c in codecs:
                run = promotions if args.promote else shares
                parts[labels[c]].append(run(c, seen, args.queries, tiers, delta_loc, args.uniform))
                tick(1)
    key_b = {labels[c]: key_bytes(c, tiers, head_dim) for c in codecs}
    radii = (
        "Tier A"
        if delta_loc is None
        else f"min(Tier A, Tier B{' uniform law' * args.uniform}), δ_loc = {delta_loc:.3g}"
    )
    console.print(
        f"{args.model}, {args.corpus}, samples={args.samples} tokens={args.tokens} queries={args.queries} "
        f"seed={args.seed}",
        highlight=False,
    )
    if args.promote:
        heavy_b = bytes_per_token_head(get(args.heavy), head_dim)
        extra = {labels[c]: heavy_b - bytes_per_token_head(get(c), head_dim) for c in codecs}
        grown = {label: (cat(p, 0), cat(p, 1)) for label, p in parts.items()}
        print_table(console, promotion_table(grown, key_b, extra, radii))
        if args.plot:
            plot_promotions(grown, args.plot, args.model)
    else:
        print_table(
            console, table({label: (cat(p, 0), cat(p, 1), cat(p, 2)) for label, p in parts.items()}, key_b, radii)
        )


if __name__ == "__main__":
    main()
