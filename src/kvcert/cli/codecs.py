"""``kvcert codecs``: every built-in codec on synthetic post-RoPE keys, with its bytes, error and certificate.

Columns carry their tier: stored bytes and true TV are *measured*, the relative key error is *empirical*, and
the Tier-A meter (``tv_meter`` over ``tier_a_radius`` of the write-time band witness) is *certified*: it
upper-bounds the true TV of every (head, query) cell. So is the box column, ``min(meter, tv_box)`` over the same
radii (the box supremum, ``docs/math.md#box-supremum``: the least bound the radii allow; paper-level): where it is
far below the meter, the form is loose; where it is not, the witness is. The lead mounts :func:`codecs` as a command.

With ``--model`` (e.g. ``smollm2-135m`` from the zoo) each codec also serves the keys of a real prompt (the
first RULER ``niah_single_1`` sample at ``--context`` tokens, shared exact prefill, ``--steps`` greedy decode
steps through a :class:`~kvcert.integrations.transformers.CertifiedCache`), and the table adds the
*informative fraction* there: the share of recorded (step, layer, query head) cells whose unclipped Tier-A
meter is below 1 (certified), and for the dithered codecs the same share under their Tier-B meter (partially
certified: queries that do not depend on the dither, failure probability at most the cache's δ). The reads run in
validate mode, so the table also gives the share of cells whose *exact* TV is at most 0.2 (measured): a sound
certificate is never below the exact TV, so no certificate of that codec can certify more cells at τ = 0.2
(``docs/math.md#p-weighted-form``); and the cells whose exact TV exceeded the certificate (must be 0).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console

from kvcert.bounds import tier_a_radius, true_tv, tv_box, tv_meter
from kvcert.cli.common import command_line, load_model
from kvcert.cli.validate import (
    OverwriteOption,
    at_least,
    checked_inputs,
    model_max_positions,
    prepare_out,
    ruler_tasks,
    seed_in_range,
)
from kvcert.eval import ruler
from kvcert.eval.branching import Scheme, run_branches
from kvcert.eval.harness import prompt_ids
from kvcert.quant import BUILTINS, bytes_per_token_head, get, quantize, sample_key
from kvcert.report import figures
from kvcert.report.results import CERTIFIED, EMPIRICAL, PARTIAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, print_table

HEADS, QUERIES, BANDS, OUTLIER_PAIRS, ROPE_BASE = 2, 4, 8, (1, 2), 10000.0


@dataclass(frozen=True)
class CodecRow:
    """One codec's measurements; ``certificate`` (the meter), ``box`` (``min(meter, tv_box)``) and ``tv`` are per cell
    ``[1, HEADS, QUERIES]`` (float64)."""

    name: str
    bytes_per_token_head: float
    relative_error: float
    certificate: torch.Tensor
    box: torch.Tensor
    tv: torch.Tensor

    @property
    def box_within(self) -> float:
        """Share of the synthetic cells whose box bound is at most ``CEILING_TAU`` (certified)."""
        return float((self.box <= CEILING_TAU).double().mean())

    @property
    def tv_within(self) -> float:
        """Share of the synthetic cells whose exact TV is at most ``CEILING_TAU`` (measured)."""
        return float((self.tv <= CEILING_TAU).double().mean())


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., T, D]`` by RoPE (rotate_half pairing) at ``positions[T]``."""
    d = x.shape[-1]
    inv_freq = ROPE_BASE ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    re, im = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([re * cos - im * sin, re * sin + im * cos], dim=-1)


def synthetic_attention(d: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE fp16-exact keys ``[1, H, tokens, d]`` with outlier pairs (×8), queries ``[1, H, Q, d]``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HEADS, tokens, d, generator=gen)
    for pair in OUTLIER_PAIRS:
        k[..., [pair, pair + d // 2]] *= 8.0
    k = rope(k, torch.arange(tokens)).to(torch.float16).to(torch.float32)
    q = rope(torch.randn(1, HEADS, QUERIES, d, generator=gen), torch.full((QUERIES,), tokens))
    return k, q


def codec_rows(d: int = 64, tokens: int = 512, seed: int = 0) -> list[CodecRow]:
    """Quantise the synthetic keys with each built-in codec and measure/certify the attention error.

    Codecs with a ``residual_window`` (KIVI) keep their most recent tokens exact, as the cache does; the
    quantised prefix is a whole number of ``block``s. Raises ``ValueError`` naming a bad argument.
    """
    if d < 32 or d % 32:
        raise ValueError(f"d must be a positive multiple of 32 (channel groups), got {d}")
    if tokens < 64:
        raise ValueError(f"tokens must be >= 64 (a KIVI block beyond its 32-token window), got {tokens}")
    k, q = synthetic_attention(d, tokens, seed)
    scale = d**-0.5
    p_exact = torch.softmax(scale * q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2), dim=-1)
    rows = []
    for name in BUILTINS:
        codec = get(name)
        n_q = (tokens - codec.residual_window) // codec.block * codec.block
        head = k[..., :n_q, :]
        res = quantize(codec, head, bands=BANDS, key=sample_key(head, seed) if codec.needs_key else None)
        k_hat = torch.cat([res.x_hat, k[..., n_q:, :]], dim=-2)
        rho = torch.cat([res.band_norms, torch.zeros(1, HEADS, tokens - n_q, BANDS, dtype=torch.float64)], -2)
        p_served = torch.softmax(scale * q.to(torch.float64) @ k_hat.to(torch.float64).transpose(-1, -2), -1)
        c = tier_a_radius(q, rho.unsqueeze(-3), scale)
        meter = tv_meter(p_served, c)
        rows.append(
            CodecRow(
                name=name,
                bytes_per_token_head=bytes_per_token_head(get(name), D=d),
                relative_error=float((k_hat - k).norm() / k.norm()),
                certificate=meter,
                box=torch.minimum(meter, tv_box(p_served, c)),
                tv=true_tv(p_exact, p_served),
            )
        )
    return rows


REAL_TASK = "niah_single_1"
REAL_VALUES = "int8"  # the informative fraction is a key certificate: values do not change it
CEILING_TAU = 0.2  # the exact-TV column: cells no sound certificate could certify at this τ are the others


@dataclass(frozen=True)
class RealInformative:
    """A key codec's informative fractions on a real prompt: ``tier_a`` (certified, sound for any query) and, for a
    dithered codec, ``tier_b`` (partially certified: non-adaptive queries, failure budget δ; ``None`` otherwise);
    ``exact_within`` the share of cells whose exact TV is ``<= CEILING_TAU`` and ``violations`` the cells whose exact
    TV exceeded the certificate (both measured in validate mode)."""

    tier_a: float
    tier_b: float | None
    exact_within: float
    violations: int


def real_informative(model: str, context: int = 1024, steps: int = 8, seed: int = 0) -> dict[str, RealInformative]:
    """Informative fraction (unclipped meter < 1) of every built-in key codec on a real prompt: the first
    ``niah_single_1`` RULER sample at ``context`` tokens through ``model`` (zoo name, local folder or
    ``tiny:<family>``), one shared exact prefill, ``steps`` greedy decode steps per codec. Tier A for every codec;
    Tier B (the dither radii under the cache's failure budget) for the dithered ones. The reads run in validate mode
    (:class:`RealInformative`)."""
    if context < 64 or steps < 2:
        raise ValueError(
            f"context must be >= 64 and steps >= 2 (the first token is the prefill's), got {context}, {steps}"
        )
    loaded = load_model(model, seed)
    sample = ruler.load_task(REAL_TASK, context, 1, seed, loaded.tokenizer_dir)[0]
    ids = prompt_ids(loaded.tokenizer, sample)
    schemes = [Scheme(name, name, REAL_VALUES, validate=True) for name in BUILTINS]
    results = run_branches(loaded.model, ids, schemes, steps, [], seed)
    out = {}
    for r in results:
        tel = r.telemetry
        if tel is None:
            continue
        rec = tel.recorded
        tier_b = None if tel.tier_b is None else float((tel.tier_b[rec] < 1).double().mean())
        within = tel.coverage(CEILING_TAU, which="true_tv")  # the exact-TV ceiling (validate mode)
        assert tel.violations is not None  # every scheme runs in validate mode
        out[r.scheme.name] = RealInformative(tel.informative_fraction, tier_b, within, tel.violations)
    return out


def _real_cells(frac: RealInformative) -> tuple[str, str, str, str]:
    def pct(x: float) -> str:  # "–" for a share of no cells (docs/cli.md)
        return "–" if math.isnan(x) else f"{100 * x:.1f}%"

    tier_b = "—" if frac.tier_b is None else pct(frac.tier_b)  # no Tier-B radius for this codec
    return pct(frac.tier_a), tier_b, pct(frac.exact_within), str(frac.violations)


def codec_results(rows: list[CodecRow], real: dict[str, RealInformative] | None) -> dict[str, Any]:
    """The ``results`` of ``results.json``: per codec its synthetic measurements and, with a real prompt, its
    fractions there, every number with its tier."""
    out: dict[str, Any] = {}
    for row in rows:
        entry = {
            "bytes_per_token_head": tiered(row.bytes_per_token_head, EMPIRICAL),
            "relative_error": tiered(row.relative_error, EMPIRICAL),
            "max_meter": tiered(float(row.certificate.max()), CERTIFIED),
            "max_box": tiered(float(row.box.max()), CERTIFIED),
            "max_true_tv": tiered(float(row.tv.max()), EMPIRICAL),
            f"box_within_{CEILING_TAU}": tiered(row.box_within, CERTIFIED),
            f"true_tv_within_{CEILING_TAU}": tiered(row.tv_within, EMPIRICAL),
        }
        if real is not None:
            frac = real[row.name]
            entry |= {
                "informative_tier_a": tiered(frac.tier_a, CERTIFIED),
                "informative_tier_b": tiered(frac.tier_b, PARTIAL),
                f"exact_tv_within_{CEILING_TAU}": tiered(frac.exact_within, EMPIRICAL),
                "violations": tiered(frac.violations, EMPIRICAL),
            }
        out[row.name] = entry
    return {"codecs": out}


def codec_figure(rows: list[CodecRow], real: dict[str, RealInformative] | None, path: Path, title: str) -> Path:
    """Shares per codec against its bytes: on the real prompt (informative Tier A, Tier B, exact TV within
    ``CEILING_TAU``) with one, else on the synthetic cells (box and true TV within ``CEILING_TAU``)."""
    size = {r.name: r.bytes_per_token_head for r in rows}
    if real is None:
        series = {
            f"synthetic cells: box <= {CEILING_TAU} (certified)": {r.name: r.box_within for r in rows},
            f"synthetic cells: true TV <= {CEILING_TAU} (measured)": {r.name: r.tv_within for r in rows},
        }
    else:
        series = {
            "informative, Tier A (certified)": {n: f.tier_a for n, f in real.items()},
            "informative, Tier B (partially certified)": {n: f.tier_b for n, f in real.items() if f.tier_b is not None},
            f"exact TV <= {CEILING_TAU} (measured; no certificate certifies more)": {
                n: f.exact_within for n, f in real.items()
            },
        }
    return figures.codec_shares(size, series, path, title)


def codecs(
    d: Annotated[int, typer.Option(help="head dimension (multiple of 32)")] = 64,
    tokens: Annotated[int, typer.Option(help="cached tokens per head (>= 64)")] = 512,
    seed: Annotated[int, typer.Option(help="RNG seed for keys, queries and dither")] = 0,
    model: Annotated[
        str | None,
        typer.Option(
            help="also measure the informative fraction on a real prompt through this model (e.g. smollm2-135m)"
        ),
    ] = None,
    context: Annotated[int, typer.Option(help="real prompt length in tokens (with --model)")] = 1024,
    steps: Annotated[
        int,
        typer.Option(
            help="greedy tokens per codec on the real prompt (with --model; >= 2: the first comes from the prefill)"
        ),
    ] = 8,
    out: Annotated[
        Path | None, typer.Option(help="also write results.json and codecs.png to this directory (default: print only)")
    ] = None,
    overwrite: OverwriteOption = False,
) -> None:
    """Compare every built-in codec: measured bytes, empirical error, certified Tier-A meter and box, measured TV, and
    (with ``--model``) the informative fractions on a real prompt (Tier A certified, Tier B partially certified), the
    share of its cells with exact TV at most 0.2 and the violations (validate mode; exit status 1 on any). With
    ``--out`` also ``results.json`` (every number with its tier) and ``codecs.png`` (the shares against the bytes)."""
    t0 = time.time()
    with checked_inputs("codecs"):
        seed_in_range(seed)
        at_least("context", context, 64)
        at_least("steps", steps, 2)
        if model is not None:
            ruler_tasks((REAL_TASK,), context)
        rows = codec_rows(d, tokens, seed)
        if model is not None:
            model_max_positions(model)
        if out is not None:
            prepare_out(out, overwrite)
    real = None if model is None else real_informative(model, context, steps, seed)
    columns = (
        "codec",
        "bytes/token-head (measured)",
        "rel. key error (empirical)",
        "max Tier-A meter (certified)",
        "max box (certified)",
        "max true TV (measured)",
        *(
            ()
            if real is None
            else (
                f"informative on {model}, Tier A (certified)",
                "Tier B (partially certified)",
                f"exact TV <= {CEILING_TAU} (measured; no certificate certifies more)",
                "violations (validate)",
            )
        ),
    )
    cells = tuple(
        (
            row.name,
            f"{row.bytes_per_token_head:.2f}",
            f"{row.relative_error:.3e}",
            f"{float(row.certificate.max()):.3e}",
            f"{float(row.box.max()):.3e}",
            f"{float(row.tv.max()):.3e}",
            *(() if real is None else _real_cells(real[row.name])),
        )
        for row in rows
    )
    title = f"built-in codecs on synthetic post-RoPE keys (D={d}, T={tokens}, seed={seed})" + (
        "" if model is None else f"; real prompt: {model}, {REAL_TASK} at {context} tokens"
    )
    console = Console(width=max(100, Console().width))
    print_table(console, ReportTable(title, columns, cells))
    if out is not None:
        config = {"d": d, "tokens": tokens, "model": model, "context": context, "steps": steps}
        if model is not None:
            config |= {"task": REAL_TASK, "values": REAL_VALUES}
        doc = build_document(
            "codecs", config, codec_results(rows, real), seed, {"seconds": time.time() - t0}, command_line().split()
        )
        json_path = write_results(out / "results.json", doc)
        where = f"on {model}, {REAL_TASK} at {context} tokens" if model else f"on synthetic keys (D={d}, T={tokens})"
        png = codec_figure(rows, real, out / "codecs.png", f"key codecs {where}; stored bytes per token and KV head")
        console.print(f"results: {json_path}\nfigure: {png}", highlight=False)
    violations = 0 if real is None else sum(f.violations for f in real.values())
    if violations:
        console.print(f"[bold red]SOUNDNESS VIOLATION: {violations} cell(s) with true TV > certificate[/]")
        raise typer.Exit(1)
