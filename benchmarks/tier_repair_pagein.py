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

Usage: ``OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tier_repair_pagein.py [--model gemma3-270m]
[--codecs dither-int5+bypass8] [--heavy dither-int8+bypass8] [--heavy-frac 0.2] [--tier-b] [--samples 1]
[--tokens 2048] [--queries 8] [--seed 11]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert import ValidationConfig  # noqa: E402
from kvcert.bounds import band_norms, tier_a_radius, tier_b_radius, tier_b_sigma2, tv_box  # noqa: E402
from kvcert.cli.progress import progress_bar  # noqa: E402
from kvcert.kernels import numba_box  # noqa: E402
from kvcert.models.zoo import load  # noqa: E402
from kvcert.quant import get  # noqa: E402
from kvcert.report.tables import ReportTable, fmt, print_table  # noqa: E402
from tv_box_tightness import BANDS, TAU, Tiers, heavy_tokens, key_bytes  # noqa: E402
from witness_tightness import Captured, capture, coded_reads, texts  # noqa: E402

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


def shares(
    codec: str, seen: Captured, nq: int, tiers: Tiers, delta_loc: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV-head read (every layer, KV head and read position): the share of its visible tokens paged in; and per
    cell (:func:`light_weights`) the light mass and ``π̃_max``."""
    names = (codec, tiers.codec)
    coded = [get(name) for name in names]
    out, masses, peaks = [], [], []
    sc = seen.scale
    for r, layer in coded_reads(seen, nq, names):
        g = r.q.shape[0]
        heavy = heavy_tokens(seen.qs[r.layer][r.head * g : (r.head + 1) * g], r.k, sc, seen.windows[r.layer], nq, tiers)
        khat = torch.where(heavy[:, None], layer[1][0][r.head], r.khat)
        radius = tier_a_radius(r.q, band_norms(khat - r.k, BANDS).unsqueeze(0), sc)
        if delta_loc is not None:
            union = []
            for tier in (0, 1):
                steps = layer[tier][1]
                if steps is None or not coded[tier].tier_b:
                    union.append(torch.full_like(radius, float("inf")))
                    continue
                proxy = tier_b_sigma2(r.q, steps[r.head], sc, getattr(coded[tier], "group_size", 0))
                union.append(tier_b_radius(proxy, r.k.shape[0], delta_loc))
            radius = torch.minimum(radius, torch.where(heavy, union[1], union[0]))
        visible = r.vis.expand(g, -1, -1)
        served = sc * r.q @ khat.T
        need = tokens_to_pass(served, sc * r.q @ r.k.T, radius.masked_fill(~visible, 0.0), visible)
        out.append(need.to(torch.float64) / visible[0].sum(-1))
        mass, peak = light_weights(served.masked_fill(~visible, float("-inf")), visible & ~heavy)
        masses.append(mass.flatten())
        peaks.append(peak.flatten())
    return torch.cat(out), torch.cat(masses), torch.cat(peaks)


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
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--corpus", default="pg-essays")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    model, tok = load(args.model)
    cfg = model.config.get_text_config()
    delta_loc = ValidationConfig().delta_loc(cfg.num_hidden_layers, cfg.num_attention_heads) if args.tier_b else None
    tiers = Tiers(args.heavy, args.heavy_frac)
    codecs = args.codecs.split(",")
    labels = {c: tiers.label(c) for c in codecs}
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {labels[c]: [] for c in codecs}
    console = Console()
    head_dim = 0
    with progress_bar("samples x codecs", args.samples * len(codecs), console) as tick:
        for text in texts(args.corpus, args.samples, args.tokens, args.seed):
            seen = capture(model, tok(text, return_tensors="pt").input_ids[:, : args.tokens])
            head_dim = seen.qs[0].shape[-1]
            for c in codecs:
                parts[labels[c]].append(shares(c, seen, args.queries, tiers, delta_loc))
                tick(1)
    rows = {label: (cat(p, 0), cat(p, 1), cat(p, 2)) for label, p in parts.items()}
    key_b = {labels[c]: key_bytes(c, tiers, head_dim) for c in codecs}
    radii = "Tier A" if delta_loc is None else f"min(Tier A, Tier B), δ_loc = {delta_loc:.3g}"
    console.print(
        f"{args.model}, {args.corpus}, samples={args.samples} tokens={args.tokens} queries={args.queries} "
        f"seed={args.seed}",
        highlight=False,
    )
    print_table(console, table(rows, key_b, radii))


if __name__ == "__main__":
    main()
