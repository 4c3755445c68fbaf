"""``kvcert audit``: where a scheme's certificate is tight or vacuous, checked against the true TV.

Runs one greedy continuation with ``validate=True``: the cache also computes the true TV of every
recorded cell from its exact host tier, so the report shows the measured error beside the certified bound.
Any cell whose true TV exceeds its certificate is a soundness violation: it is reported loudly and the
command exits with status 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console

from kvcert.cache.telemetry import Telemetry
from kvcert.cli.common import ModelOption, command_line, default_out, load_model, parse_schemes, set_seed
from kvcert.cli.validate import (
    OverwriteOption,
    at_least,
    checked_inputs,
    context_fits,
    fail,
    model_max_positions,
    prepare_out,
    ruler_tasks,
    seed_in_range,
)
from kvcert.eval import ruler
from kvcert.eval.branching import Scheme, run_branches
from kvcert.eval.harness import prompt_ids
from kvcert.report import aggregate, figures
from kvcert.report.html import write_html
from kvcert.report.results import CERTIFIED, EMPIRICAL, PARTIAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, fmt, print_table

TAU = 0.2
QUANTILES = {"p10": 0.1, "median": 0.5, "p90": 0.9}


def tightness(tel: Telemetry) -> dict[str, float]:
    """Distribution of ``true TV / certificate`` over the recorded cells with a positive certificate
    (validate mode): ``p10`` / ``median`` / ``p90`` over all of them, the same over the *informative* cells
    (unclipped meter < 1, where the bound says something), and the cell counts. Soundness means every ratio is
    ``<= 1``; a ratio near 1 means the bound is tight, near 0 that it is loose. Empirical (measured TV over a
    certified bound). NaN where no cell qualifies."""
    if tel.true_tv is None:
        raise ValueError("tightness needs validate-mode telemetry (true_tv)")
    rec = tel.recorded
    cert, tv, raw = tel.certificates[rec], tel.true_tv[rec], tel.raw[rec]
    out: dict[str, float] = {}
    for scope, keep in (("", cert > 0), ("informative_", (cert > 0) & (raw < 1))):
        ratio = (tv[keep] / cert[keep]).double()
        for name, q in QUANTILES.items():
            out[f"tightness_{scope}{name}"] = float(torch.quantile(ratio, q)) if ratio.numel() else float("nan")
        out[f"tightness_{scope}cells"] = int(keep.sum())
    return out


def audit_numbers(tel: Telemetry) -> dict[str, Any]:
    """Tiered headline numbers of one validated telemetry, plus a per-layer breakdown."""
    cert_map = aggregate.certificate_map([tel])
    sat_map = aggregate.saturation_map([tel])
    out: dict[str, Any] = {
        "cells": tiered(tel.cells, EMPIRICAL),
        "coverage_q@0.2": tiered(tel.coverage(TAU, "q_head"), CERTIFIED),
        "coverage_kv@0.2": tiered(tel.coverage(TAU, "kv_head"), CERTIFIED),
        "coverage_tanh_q@0.2": tiered(tel.coverage(TAU, "q_head", which="tanh"), CERTIFIED),
        "informative_fraction": tiered(tel.informative_fraction, CERTIFIED),
        "max_certificate": tiered(tel.max_certificate, CERTIFIED),
        "violations": tiered(tel.violations, EMPIRICAL),
        "out_violations": tiered(tel.out_violations, EMPIRICAL),
        "max_true_tv": tiered(float(aggregate.cells([tel], "true_tv").max()) if tel.cells else None, EMPIRICAL),
        "bytes_stored": tiered(tel.bytes_stored, EMPIRICAL),
        "bytes_device": tiered(tel.bytes_device, EMPIRICAL),
        "capacity": tiered(tel.capacity, EMPIRICAL),
        "bytes_fp16": tiered(tel.bytes_fp16, EMPIRICAL),
        **{k: tiered(v, EMPIRICAL) for k, v in tightness(tel).items()},
        "fail_closed": tiered(tel.fail_closed, EMPIRICAL),
        "per_layer": [
            {
                "layer": tiered(i, EMPIRICAL),
                "mean_certificate": tiered(float(cert_map[i].nanmean()), CERTIFIED),
                "saturated_fraction": tiered(float(sat_map[i].nanmean()), CERTIFIED),
            }
            for i in range(cert_map.shape[0])
        ],
    }
    if tel.tier_b is not None:
        out["coverage_tier_b_kv@0.2"] = tiered(tel.coverage(TAU, "kv_head", which="tier_b"), PARTIAL)
    if tel.true_tv is not None:  # the exact-TV ceiling: no certificate covers more at τ
        out["ceiling_q@0.2"] = tiered(tel.coverage(TAU, "q_head", which="true_tv"), EMPIRICAL)
        out["ceiling_kv@0.2"] = tiered(tel.coverage(TAU, "kv_head", which="true_tv"), EMPIRICAL)
    return out


def audit_figures(tel: Telemetry, label: str, out: Path) -> list[Path]:
    """Heatmap, saturation map, coverage-vs-τ, true TV vs bound and (dithered keys) Tier A vs Tier B."""
    figs = [
        figures.layer_head_map(
            aggregate.certificate_map([tel]),
            out / "heatmap.png",
            f"{label}: mean certified TV bound per layer × head",
            "TV bound",
        ),
        figures.layer_head_map(
            aggregate.saturation_map([tel]),
            out / "saturation.png",
            f"{label}: fraction of saturated cells (meter ≥ 1)",
            "fraction",
        ),
    ]
    series = {
        "Tier A certificate": aggregate.cells([tel], "certificates"),
        "tanh bound": aggregate.cells([tel], "tanh"),
        "true TV (measured; no certificate covers more)": aggregate.cells([tel], "true_tv"),
    }
    if tel.tier_b is not None:
        series["Tier B (partial)"] = aggregate.cells([tel], "tier_b")
    figs.append(figures.coverage_curve(series, out / "coverage_vs_tau.png", f"{label}: coverage vs τ"))
    figs.append(
        figures.bound_scatter(
            aggregate.cells([tel], "true_tv"),
            aggregate.cells([tel], "certificates"),
            out / "true_tv_vs_bound.png",
            "true TV (measured)",
            "certificate (certified)",
            f"{label}: every point must lie on or above y = x",
        )
    )
    if tel.tier_b is not None:
        figs.append(
            figures.bound_scatter(
                aggregate.cells([tel], "certificates"),
                aggregate.cells([tel], "tier_b"),
                out / "tier_a_vs_tier_b.png",
                "Tier A (certified)",
                "Tier B (partial: non-adaptive queries)",
                f"{label}: Tier A vs Tier B",
            )
        )
    return figs


def _input_ids(loaded: Any, prompt_file: Path | None, task: str | None, context: int, seed: int) -> torch.Tensor:
    if prompt_file is not None:
        text = prompt_file.read_text(encoding="utf-8")
        ids = loaded.tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] < 2:
            fail("audit", f"--prompt-file {prompt_file} holds fewer than 2 tokens")
        return ids
    assert task is not None
    sample = ruler.load_task(task, context, 1, seed, loaded.tokenizer_dir)[0]
    return prompt_ids(loaded.tokenizer, sample)


def _check_prompt(prompt_file: Path | None, task: str | None, context: int) -> None:
    """Exactly one prompt source: a readable UTF-8 text file, or a RULER task at a context it supports."""
    if (prompt_file is None) == (task is None):
        raise ValueError("give exactly one of --prompt-file or --task")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise ValueError(f"--prompt-file {prompt_file} does not exist")
        try:
            prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--prompt-file {prompt_file} is not readable UTF-8 text ({type(exc).__name__})") from None
    else:
        assert task is not None
        ruler_tasks((task,), context, "--task")


def audit(
    keys: Annotated[str, typer.Option(help="key codec (registry name)")],
    values: Annotated[str | None, typer.Option(help="value codec (default: same as --keys)")] = None,
    model: ModelOption = "smollm2-135m",
    prompt_file: Annotated[Path | None, typer.Option(help="text file to use as the prompt")] = None,
    task: Annotated[str | None, typer.Option(help="RULER task whose first sample is the prompt")] = None,
    context: Annotated[int, typer.Option(help="RULER length for --task")] = 2048,
    max_new_tokens: Annotated[
        int,
        typer.Option(help="greedy tokens (>= 2: the first comes from the exact prefill, the rest read the cache)"),
    ] = 16,
    seed: Annotated[int, typer.Option(help="seed for data and codecs")] = 0,
    out: Annotated[Path | None, typer.Option(help="report directory (default runs/audit-<timestamp>)")] = None,
    overwrite: OverwriteOption = False,
) -> None:
    """Per layer × head certificate heatmap, saturation map, coverage vs τ, Tier A vs Tier B (dithered keys)
    and the validate-mode true TV beside the bound. Exits 1 if any cell's true TV exceeds its certificate or any true
    output error its output bound, and if no read went through the compressed cache (nothing audited)."""
    console = Console()
    out = out or default_out("audit")
    with checked_inputs("audit"):
        spec = parse_schemes(keys if values is None else f"{keys}/{values}")[0]
        at_least("max-new-tokens", max_new_tokens, 2)
        seed_in_range(seed)
        _check_prompt(prompt_file, task, context)
        positions = model_max_positions(model)
        if task is not None:
            context_fits(context, positions)
        prepare_out(out, overwrite)
    t0 = time.time()
    set_seed(seed)
    loaded = load_model(model, seed)
    ids = _input_ids(loaded, prompt_file, task, context, seed)
    console.print(f"auditing {spec.label} on {ids.shape[1]} prompt tokens (validate mode) ...")
    with console.status("prefill + validated decode"):
        res = run_branches(
            loaded.model,
            ids,
            [Scheme(spec.label, spec.keys, spec.values, validate=True)],
            max_new_tokens,
            loaded.eos_ids,
            seed,
        )[0]
    tel = res.telemetry
    assert tel is not None
    numbers = audit_numbers(tel)
    out.mkdir(parents=True, exist_ok=True)
    figs = audit_figures(tel, spec.label, out)
    config = {
        "model": model,
        "keys": spec.keys,
        "values": spec.values,
        "task": task,
        "context": context,
        "prompt_file": None if prompt_file is None else str(prompt_file),
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "out": str(out),
    }
    doc = build_document(
        "audit",
        config,
        {"scheme": spec.label, **numbers},
        seed,
        {"seconds": time.time() - t0},
        command_line().split(),
    )
    json_path = write_results(out / "results.json", doc)
    keys_shown = (
        "cells",
        "coverage_q@0.2",
        "coverage_kv@0.2",
        "coverage_tier_b_kv@0.2",
        "coverage_tanh_q@0.2",
        "ceiling_q@0.2",
        "ceiling_kv@0.2",
        "informative_fraction",
        "max_certificate",
        "max_true_tv",
        "tightness_p10",
        "tightness_median",
        "tightness_p90",
        "tightness_cells",
        "tightness_informative_median",
        "tightness_informative_cells",
        "violations",
        "fail_closed",
        "bytes_device",
        "capacity",
    )
    table = ReportTable(
        f"audit {spec.label} on {model}",
        ("quantity", "value", "tier"),
        tuple((k, fmt(numbers[k]["value"], 4), numbers[k]["tier"]) for k in keys_shown if k in numbers),
    )
    html_path = write_html(
        out / "report.html",
        f"kvcert audit: {spec.label}",
        [
            f"{ids.shape[1]} prompt tokens, {len(res.tokens)} decoded tokens, validate mode.",
            "tightness = true TV / certificate per cell with a positive certificate (p10, median, p90; "
            "'informative' restricts to cells whose unclipped meter is < 1): 1 is a tight bound, 0 a loose one, "
            "above 1 a violation. Empirical (measured TV over a certified bound).",
            "ceiling = share of cells (q) or KV-head reads (kv) whose exact TV is <= 0.2: a sound certificate is never "
            "below the exact TV, so no certificate of this scheme's codecs covers more. Empirical.",
        ],
        [table],
        figs,
        command_line(),
    )
    print_table(console, table)
    console.print(f"results: {json_path}\nreport: [bold]{html_path}[/]")
    if tel.cells == 0:  # e.g. EOS first: nothing read the compressed cache, so nothing was audited
        console.print("[bold red]NOTHING AUDITED: no decode read went through the compressed cache (0 cells)[/]")
        raise typer.Exit(1)
    if tel.violations or tel.out_violations:
        console.print(
            f"[bold red]SOUNDNESS VIOLATION: {tel.violations} cell(s) with true TV > certificate, "
            f"{tel.out_violations} with true output error > output bound[/]"
        )
        raise typer.Exit(1)
