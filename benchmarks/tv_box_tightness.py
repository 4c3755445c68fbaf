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
[--intervals 16] [--plot FILE] [--plot-ceiling FILE] [--tier-b] [--heavy CODEC --heavy-fracs 0.1,0.2,0.3
--tier-values int2/int4]``. With ``--heavy``, every row is a token-tier row (:class:`Tiers`): each ``--codecs`` entry is
the light codec, and a fourth table gives the bytes, what the gate's box passes, the exact-TV ceiling and the ceiling
of the light-atom form (``docs/math.md#light-atom``). Tiers: both certificates certified (Tier A, any query); the
min(A, B) box partially certified; exact TV and the oracle ceilings empirical.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcert import StorageConfig, ValidationConfig  # noqa: E402
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


@dataclass(frozen=True)
class Tiers:
    """Token tiers (``--heavy``): per KV head, ``frac`` of the tokens stored with ``codec`` (the heavy tier), the rest
    with the row's codec (the light tier). The heavy tokens are fixed before the reads, SnapKV-style, from the prefill
    alone (:func:`heavy_tokens`)."""

    codec: str
    frac: float
    window: int = 32  # the observation window: the last prefill positions before the reads
    sinks: int = 4

    def label(self, light: str) -> str:
        """The row's keys: ``light + 20% heavy``."""
        return f"{light} + {self.frac:.0%} {self.codec}"


def heavy_tokens(
    q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None, nq: int, tiers: Tiers
) -> torch.Tensor:
    """``[S]`` bool, the heavy tier of one KV head: the first ``tiers.sinks`` tokens, every token from the observation
    window on (its ``tiers.window`` prefill positions and the ``nq`` reads'), and the prefix tokens with the most
    attention from the observation window's queries (``q[G, S, D]``, the KV head's query group at every position,
    over the exact keys ``k[S, D]``; summed over the query heads and the window, averaged over 7 neighbours), up to
    ``round(frac·S)`` tokens in all. Nothing after the prefill is looked at. ``window``: the layer's sliding window."""
    s = k.shape[0]
    obs = s - nq - tiers.window
    heavy = torch.zeros(s, dtype=torch.bool)
    heavy[: tiers.sinks] = True
    heavy[obs:] = True
    n = round(tiers.frac * s) - int(heavy.sum())
    if obs <= tiers.sinks or n < 0:
        raise ValueError(
            f"heavy fraction {tiers.frac} of {s} tokens is below the {int(heavy.sum())} tokens the tier always holds "
            f"(sinks, observation window and reads)"
        )
    pos, t = torch.arange(obs, s - nq).view(-1, 1), torch.arange(s).view(1, -1)
    vis = (t <= pos) & (pos - t < window) if window else t <= pos
    att = torch.softmax((scale * q[:, obs : s - nq] @ k.T).masked_fill(~vis, float("-inf")), -1).sum((0, 1))
    score = torch.nn.functional.avg_pool1d(att.view(1, 1, -1), 7, 1, 3, count_include_pad=False).view(-1)
    heavy[score.masked_fill(heavy, float("-inf")).topk(n).indices] = True
    return heavy


def light_atom_form(
    served: torch.Tensor,
    exact: torch.Tensor,
    served_logit: torch.Tensor,
    exact_logit: torch.Tensor,
    radius: torch.Tensor,
    light: torch.Tensor,
) -> torch.Tensor:
    """``tv_box(P̃, (c_H, |ε_L|)) + M̃_L·TV(π, π̃)`` (``docs/math.md#light-atom``): the tokens outside ``light`` as atoms
    with their ``radius``, the light tokens as one atom of served mass ``M̃_L`` and log-mass error
    ``ε_L = lse_L(s̃) − lse_L(s)``, and ``π``, ``π̃`` the exact and served attention within the light set. An upper
    bound on ``TV(p, p̃)`` whenever ``radius`` bounds the heavy tokens' logit errors; with this draw's own ``ε_L`` and
    ``TV(π, π̃)`` it is the ceiling of the bounds that treat the light tokens as one atom, not a certificate. All
    tensors ``[..., S]`` (``light`` broadcasts); a row without light tokens reduces to the box."""
    light = light.expand_as(served)
    ninf = float("-inf")
    served_light, exact_light = served.masked_fill(~light, 0.0), exact.masked_fill(~light, 0.0)
    mass = served_light.sum(-1, keepdim=True)
    lse = lambda x: torch.logsumexp(x.masked_fill(~light, ninf), -1, keepdim=True)  # noqa: E731
    eps_light = (lse(served_logit) - lse(exact_logit)).abs().nan_to_num(0.0)  # no light token: −inf − (−inf)
    coarse = tv_box(
        torch.cat([served.masked_fill(light, 0.0), mass], -1),
        torch.cat([radius.masked_fill(light, 0.0), eps_light], -1),
        rows=numba_box.box_rows,
    )
    within = true_tv(
        exact_light / exact_light.sum(-1, keepdim=True).clamp(min=1e-300), served_light / mass.clamp(min=1e-300)
    )
    return coarse + mass.squeeze(-1) * within


def cells(
    codec: str,
    seen: Captured,
    nq: int,
    intervals: int,
    delta_loc: float | None = None,
    tiers: Tiers | None = None,
) -> dict[str, torch.Tensor]:
    """Per cell of every layer and query head: exact TV, the meter (clipped, unclipped) and ``min(meter, box)``; and
    the seconds spent in the meter, in ``tv_box`` and in its compiled evaluation (one thread's clock, side by side on
    the same cells), and each cell's relative difference of the two evaluations (``gap``). ``kv_box``: per KV-head
    read (a decode step of one KV head), whether every query head's box is ``<= τ`` (what a head gate passes).
    A layer with a sliding window (``seen.windows``) reads only its window.

    With ``delta_loc`` and a dithered codec, also ``partial`` (and ``kv_partial``): ``min(meter, box)`` over the radii
    ``min(c_t, u_t)``, ``u_t`` the Tier-B union radius at ``delta_loc`` (``docs/math.md#tier-b-radius``): partially
    certified (non-adaptive queries; it fails with probability at most ``delta_loc`` per cell).

    With ``tiers`` (:class:`Tiers`), the heavy tokens of each KV head are served by ``tiers.codec`` (with its own
    radii) and the rest by ``codec``; also ``light`` (the served attention mass on the light tokens, per cell),
    ``light_form`` (:func:`light_atom_form`, per cell) and ``kv_light`` (per KV-head read, whether it is ``<= τ`` on
    every query head); with Tier B also ``light_sigma`` (per cell, the largest proxy ``σ_t`` of a light token's logit
    error, ``docs/math.md#light-atom``)."""
    tv, meter, raw, box, gap, kv_box, kv_exact, pweighted, heaviest, partial, kv_partial = ([] for _ in range(11))
    light_mass, light_form, kv_light, light_sigma = [], [], [], []
    spent = torch.zeros(3, dtype=torch.float64)
    names = (codec,) if tiers is None else (codec, tiers.codec)  # the light tier first
    codecs = [get(name) for name in names]
    tier_b = delta_loc is not None and codecs[0].tier_b
    layer: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # per tier: the served keys and steps of the layer
    sc = seen.scale

    def serve(k: torch.Tensor) -> torch.Tensor:  # one call per layer, before its heads' reads
        layer[:] = [encoded(Candidate(name, name, {}), k) for name in names]
        return layer[0][0]

    def sigma2(qq: torch.Tensor, tier: int, head: int) -> torch.Tensor | None:
        """The Tier-B proxy of every token under tier ``tier``'s code (``None``: that code has no Tier-B radius)."""
        steps = layer[tier][1]
        if delta_loc is None or steps is None or not codecs[tier].tier_b:
            return None
        return tier_b_sigma2(qq, steps[head], sc, getattr(codecs[tier], "group_size", 0))

    def union_radius(proxy: torch.Tensor | None, s: int) -> torch.Tensor:
        if proxy is None:
            return torch.full((), float("inf"), dtype=torch.float64)  # no Tier-B radius: min(c, u) = c
        return tier_b_radius(proxy, s, delta_loc)

    for r in head_reads(seen, nq, serve):
        vis, qq = r.vis, r.q
        khat, heavy = r.khat, torch.zeros(r.k.shape[0], dtype=torch.bool)
        if tiers is not None:
            g = qq.shape[0]
            q_group = seen.qs[r.layer][r.head * g : (r.head + 1) * g]
            heavy = heavy_tokens(q_group, r.k, sc, seen.windows[r.layer], nq, tiers)
            khat = torch.where(heavy[:, None], layer[1][0][r.head], khat)
        c = tier_a_radius(qq, band_norms(khat - r.k, BANDS).unsqueeze(0), sc).masked_fill(~vis, 0.0)
        served_logit, exact_logit = sc * qq @ khat.T, sc * qq @ r.k.T
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
        radius, proxy = c, sigma2(qq, 0, r.head)
        if tier_b:
            s = r.k.shape[0]
            u = union_radius(proxy, s)
            if tiers is not None:
                u = torch.where(heavy, union_radius(sigma2(qq, 1, r.head), s), u)
            radius = torch.minimum(c, u).masked_fill(~vis, 0.0)
            cell_partial = torch.minimum(meter_and_unclipped(p, radius)[0], tv_box(p, radius, rows=numba_box.box_rows))
            partial.append(cell_partial.flatten())
            kv_partial.append((cell_partial <= TAU).all(0))
        if tiers is not None:
            light = vis & ~heavy
            light_mass.append(p.masked_fill(~light, 0.0).sum(-1).flatten())
            form = light_atom_form(p, exact, served_logit, exact_logit, radius, light)
            light_form.append(form.flatten())
            kv_light.append((form <= TAU).all(0))
            if proxy is not None:
                light_sigma.append(proxy.sqrt().masked_fill(~light, 0.0).amax(-1).flatten())
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
    if tiers is not None:
        out |= {"light": torch.cat(light_mass), "light_form": torch.cat(light_form), "kv_light": torch.cat(kv_light)}
        if light_sigma:
            out["light_sigma"] = torch.cat(light_sigma)
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


def key_bytes(codec: str, tiers: Tiers | None, head_dim: int) -> float:
    """Measured key bytes per (token, KV head) of a row: the codec's packed tensors, or with ``tiers`` the mix
    ``(1 − frac)·B(codec) + frac·B(tiers.codec)``, plus the store's log8 witness codes (the same for every row)."""
    light = bytes_per_token_head(get(codec), head_dim)
    codes = (
        light
        if tiers is None
        else (1 - tiers.frac) * light + tiers.frac * bytes_per_token_head(get(tiers.codec), head_dim)
    )
    return codes + StorageConfig(seed=0).store(0).cell_layout(head_dim, head_dim).witness_bytes


def plot_ceiling(results: dict[str, dict[str, torch.Tensor]], size: dict[str, float], path: Path, model: str) -> None:
    """Per row (by its key bytes, ``size``): the share of KV-head reads a head gate at τ passes over Tier A, over
    min(Tier A, Tier B), and the most any sound gate could pass (exact TV ``<= τ`` on every query head); for token-tier
    rows also the light-atom ceiling."""
    series = {
        f"exact TV <= {TAU} (no sound gate passes more; measured)": {
            c: float(r["kv_exact"].double().mean()) for c, r in results.items()
        },
        f"light-atom form <= {TAU} at the draw's own errors (token tiers; measured)": {
            c: float(r["kv_light"].double().mean()) for c, r in results.items() if "kv_light" in r
        },
        f"box over min(Tier A, Tier B) <= {TAU} (partially certified)": {
            c: float(r["kv_partial"].double().mean()) for c, r in results.items() if "kv_partial" in r
        },
        f"box over Tier A <= {TAU} (certified)": {c: float(r["kv_box"].double().mean()) for c, r in results.items()},
    }
    title = f"{model}: KV-head reads a head gate at τ = {TAU} passes"
    figures.codec_shares(size, series, path, title, xlabel="share of KV-head reads")


def tier_table(
    results: dict[str, dict[str, torch.Tensor]],
    rows: dict[str, tuple[str, Tiers | None]],
    values: tuple[str, str],
    head_dim: int,
    model: str,
) -> ReportTable:
    """Per token-tier row: the measured bytes (keys with witnesses, and keys + values with ``values`` = (light,
    heavy) value codecs, as capacity against fp16), what a head gate at τ passes (Tier A; min(A, B)), the exact-TV
    ceiling, the served light mass and the light-atom ceiling (:func:`light_atom_form`)."""
    out = []
    for label, r in results.items():
        codec, tiers = rows[label]
        if tiers is None:
            continue
        keys = key_bytes(codec, tiers, head_dim)
        light_v, heavy_v = (bytes_per_token_head(get(v), head_dim) for v in values)
        kv = keys + (1 - tiers.frac) * light_v + tiers.frac * heavy_v
        out.append(
            (
                label,
                fmt(keys),
                fmt(4 * head_dim / kv),
                fmt(float(r["kv_box"].double().mean()), percent=True),
                fmt(float(r["kv_partial"].double().mean()), percent=True) if "kv_partial" in r else "–",
                fmt(float(r["kv_exact"].double().mean()), percent=True),
                fmt(float(r["light"].median())),
                fmt(float(r["light"].quantile(0.9))),
                fmt(float(r["kv_light"].double().mean()), percent=True),
                fmt(float(r["light_sigma"].median())) if "light_sigma" in r else "–",
            )
        )
    return ReportTable(
        f"Token tiers on {model}: heavy tokens (chosen from the prefill) in a wider code, the rest narrow",
        (
            "keys (light + heavy share)",
            "key B/token/KV head",
            f"capacity with {values[0]}/{values[1]} values",
            f"Tier A: KV heads <= {TAU}",
            f"min(A, B): KV heads <= {TAU}",
            f"exact TV: KV heads <= {TAU}",
            "median light mass",
            "p90 light mass",
            f"light-atom form: KV heads <= {TAU}",
            "median max σ_t of the light tokens",
        ),
        tuple(out),
        "Per KV head the heavy share of tokens is fixed before the reads from the prefill alone: the first 4 tokens, "
        "the observation window (the last 32 prefill positions) and the reads, and the prefix tokens the window's "
        "queries attend to most. Bytes measured from the packed tensors (codes, scales, bypassed pairs) plus the log8 "
        "witnesses; capacity = fp16 K/V over keys + values (light value codec on the light tokens, heavy on the "
        "heavy). light mass = served attention on the light tokens, per cell. light-atom form = tv_box over the heavy "
        "tokens with their radii and the light set as one atom at this draw's own log-mass error, plus the light mass "
        "times the exact within-light TV (docs/math.md#light-atom): the ceiling of the bounds that treat the light "
        "tokens as one atom. max σ_t = the largest Tier-B proxy of a light token's logit error in a cell (what a sound "
        "bound on the light atom pays for, times √(2 ln(1/δ)), docs/math.md#light-atom). Tiers: Tier A certified, "
        "min(A, B) partially certified, the rest empirical.",
    )


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
    ap.add_argument(
        "--heavy", default=None, help="token tiers: the heavy tokens' key codec (each --codecs is the light)"
    )
    ap.add_argument("--heavy-fracs", default="0.1,0.2,0.3", help="token tiers: the heavy shares of the tokens")
    ap.add_argument("--tier-values", default="int2/int4", help="token tiers: value codecs LIGHT/HEAVY (bytes only)")
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    for name in codecs:
        get(name)  # an unknown codec fails here, before the model loads
    model, tok = load(args.model)
    cfg = model.config
    delta_loc = ValidationConfig().delta_loc(cfg.num_hidden_layers, cfg.num_attention_heads) if args.tier_b else None
    rows: dict[str, tuple[str, Tiers | None]] = {c: (c, None) for c in codecs}
    if args.heavy is not None:
        get(args.heavy)
        fracs = [float(f) for f in args.heavy_fracs.split(",")]
        rows = {Tiers(args.heavy, f).label(c): (c, Tiers(args.heavy, f)) for c in codecs for f in fracs}
    values = tuple(args.tier_values.split("/"))
    if len(values) != 2:
        raise SystemExit(f"--tier-values wants LIGHT/HEAVY value codecs, got {args.tier_values!r}")
    for name in values:
        get(name)
    parts: dict[str, list[dict[str, torch.Tensor]]] = {label: [] for label in rows}
    console = Console()
    with progress_bar("samples x rows", args.samples * len(rows), console) as tick:
        for text in texts(args.corpus, args.samples, args.tokens, args.seed):
            ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
            seen = capture(model, ids)
            for label, (codec, tiers) in rows.items():
                parts[label].append(cells(codec, seen, args.queries, args.intervals, delta_loc, tiers))
                tick(1)
    results = {
        c: {k: torch.stack([p[k] for p in ps]).sum(0) if k == "spent" else torch.cat([p[k] for p in ps]) for k in ps[0]}
        for c, ps in parts.items()
    }
    head_dim = seen.qs[0].shape[-1]
    console.print(
        f"{args.model}, {args.corpus}, samples={args.samples} tokens={args.tokens} queries/sample={args.queries} "
        f"seed={args.seed}",
        highlight=False,
    )
    print_table(console, table(results, args.intervals, args.model))
    print_table(console, gate_table(results, delta_loc, args.model))
    print_table(console, ceiling_table(results, args.model))
    if args.heavy is not None:
        print_table(console, tier_table(results, rows, (values[0], values[1]), head_dim, args.model))
    if args.plot is not None:
        plot(results, args.plot, args.model)
        console.print(f"figure: {args.plot}", highlight=False)
    if args.plot_ceiling is not None:
        size = {label: key_bytes(codec, tiers, head_dim) for label, (codec, tiers) in rows.items()}
        plot_ceiling(results, size, args.plot_ceiling, args.model)
        console.print(f"figure: {args.plot_ceiling}", highlight=False)
    if any(
        int((r["tv"] > r["box"]).sum())
        + int((r["tv"] > r.get("partial", r["box"])).sum())
        + int((r["tv"] > r["pweighted"]).sum())
        + int((r["tv"] > r.get("light_form", r["box"])).sum())
        for r in results.values()
    ):
        raise SystemExit("VIOLATIONS FOUND")


if __name__ == "__main__":
    main()
