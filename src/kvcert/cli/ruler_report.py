"""Turn a :class:`~kvcert.cli.workload.WorkloadResult` into results.json, PNGs, report.html and a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcert.cli.workload import DENSE, VariantRecord, WorkloadResult
from kvcert.eval.stats import mcnemar, paired_bootstrap
from kvcert.report import aggregate, figures
from kvcert.report.html import write_html
from kvcert.report.results import CERTIFIED, EMPIRICAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, fmt

COVERAGE_TAU = 0.2


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def variant_numbers(rec: VariantRecord, dense: VariantRecord, seed: int, resamples: int) -> dict[str, Any]:
    """Tiered numbers of one variant: accuracy and paired stats vs dense (empirical), meter (certified),
    bytes / page-in / fallback (empirical measurements)."""
    out: dict[str, Any] = {
        "accuracy": tiered(_mean(rec.scores), EMPIRICAL),
        "samples": tiered(len(rec.scores), EMPIRICAL),
    }
    if rec.label != DENSE:
        boot = paired_bootstrap(dense.scores, rec.scores, resamples=resamples, seed=seed)
        mc = mcnemar([s >= 1.0 for s in dense.scores], [s >= 1.0 for s in rec.scores])
        out.update(
            {
                "diff_vs_dense": tiered(boot.diff, EMPIRICAL),
                "ci95_low": tiered(boot.low, EMPIRICAL),
                "ci95_high": tiered(boot.high, EMPIRICAL),
                "mcnemar_p": tiered(mc.p_exact, EMPIRICAL),
                "bootstrap_resamples": tiered(boot.resamples, EMPIRICAL),
            }
        )
    tels = rec.telemetry
    if tels:
        fp16_tok = aggregate.fp16_bytes_per_token(tels[0])
        frac = aggregate.stored_fraction(tels)
        fallback = aggregate.pooled(tels, lambda t: t.fallback_rate)
        b_eff = aggregate.pooled(tels, lambda t: t.effective_bits)
        out.update(
            {
                "bytes_per_token_stored": tiered(fp16_tok * frac, EMPIRICAL),
                "bytes_per_token_effective": tiered(fp16_tok * b_eff / 16.0, EMPIRICAL),
                "bytes_per_token_fp16": tiered(fp16_tok, EMPIRICAL),
                "effective_bits": tiered(b_eff, EMPIRICAL),
                "page_in_bytes": tiered(sum(t.bytes_paged for t in tels), EMPIRICAL),
                "fallback_rate": tiered(fallback, EMPIRICAL),
                "coverage_q@0.2": tiered(
                    aggregate.pooled(tels, lambda t: t.coverage(COVERAGE_TAU, "q_head")), CERTIFIED
                ),
                "coverage_kv@0.2": tiered(
                    aggregate.pooled(tels, lambda t: t.coverage(COVERAGE_TAU, "kv_head")), CERTIFIED
                ),
                "informative_fraction": tiered(
                    aggregate.pooled(tels, lambda t: t.informative_fraction), CERTIFIED
                ),
                "max_certificate": tiered(  # samples with no cell (NaN) do not count, in any order
                    max((m for t in tels if (m := t.max_certificate) == m), default=None), CERTIFIED
                ),
                "cells": tiered(sum(t.cells for t in tels), EMPIRICAL),
                "fail_closed": tiered(sum(t.fail_closed for t in tels), EMPIRICAL),
            }
        )
        if tels[0].true_tv is not None:
            out["violations"] = tiered(sum(t.violations for t in tels), EMPIRICAL)
    return out


def results_section(result: WorkloadResult, seed: int, resamples: int) -> dict[str, Any]:
    """The ``results`` part of results.json for a RULER workload."""
    dense = result.variant(DENSE)
    variants = {}
    for rec in result.variants:
        variants[rec.label] = {
            "gate": rec.gate.describe(),
            "codecs": None if rec.spec is None else {"keys": rec.spec.keys, "values": rec.spec.values},
            **variant_numbers(rec, dense, seed, resamples),
        }
    per_sample = [
        {
            "task": s.task,
            "index": tiered(s.index, EMPIRICAL),
            "references": list(s.outputs),
            "scores": {r.label: tiered(r.scores[i], EMPIRICAL) for r in result.variants},
            "predictions": {r.label: r.predictions[i] for r in result.variants},
        }
        for i, s in enumerate(result.samples)
    ]
    choice = {
        k: {kk: (tiered(vv, CERTIFIED) if isinstance(vv, float) else vv) for kk, vv in v.items()}
        for k, v in result.gate_choice.items()
    }
    return {"variants": variants, "gate_choice": choice, "per_sample": per_sample}


def summary_table(results: dict[str, Any]) -> ReportTable:
    """One row per variant: accuracy, paired CI vs dense, McNemar p, bytes, page-in, fallback, coverage."""
    rows = []
    for label, v in results["variants"].items():

        def val(key: str, v: dict[str, Any] = v) -> Any:
            return v[key]["value"] if key in v else None

        ci = (
            "–"
            if val("ci95_low") is None
            else f"[{100 * val('ci95_low'):+.1f}, {100 * val('ci95_high'):+.1f}]"
        )
        rows.append(
            (
                label,
                v["gate"],
                fmt(val("accuracy"), percent=True),
                ci,
                fmt(val("mcnemar_p"), 2),
                fmt(val("bytes_per_token_stored") or val("bytes_per_token_fp16"), 4),
                fmt(val("page_in_bytes")),
                fmt(val("fallback_rate"), percent=True),
                fmt(val("coverage_kv@0.2"), percent=True),
                fmt(val("informative_fraction"), percent=True),
            )
        )
    return ReportTable(
        "RULER accuracy per scheme (paired against dense on the same samples)",
        (
            "scheme",
            "gate",
            "acc",
            "Δ CI95 (pp)",
            "McN p",
            "B/tok",
            "page-in B",
            "fallbk",
            "cov@0.2",
            "inform",
        ),
        tuple(rows),
        "acc = RULER accuracy; Δ CI95 = paired bootstrap CI of acc − dense acc; McN p = exact McNemar p; "
        "B/tok = stored KV bytes per token, all layers (dense: fp16); fallbk = share of KV-head reads paged "
        "in; cov@0.2 = share of KV-head cells whose certified TV bound is <= 0.2; inform = share of cells "
        "with meter < 1. Tiers: acc, CI, p, bytes, page-in, fallback empirical; cov and inform certified.",
    )


def _figures(result: WorkloadResult, results: dict[str, Any], out: Path) -> list[Path]:
    figs = []
    compressed = [r for r in result.variants if r.telemetry]
    raw = [r for r in compressed if not r.gated]
    if raw:
        figs.append(
            figures.coverage_curve(
                {r.label: aggregate.cells(r.telemetry, "certificates") for r in raw},
                out / "coverage_vs_tau.png",
                "coverage vs τ per scheme, ungated (certified bounds, q-head cells)",
            )
        )
        worst = min(raw, key=lambda r: aggregate.pooled(r.telemetry, lambda t: t.informative_fraction))
        best = max(raw, key=lambda r: aggregate.pooled(r.telemetry, lambda t: t.informative_fraction))
        for rec in dict.fromkeys([best.label, worst.label]):
            r = result.variant(rec)
            safe = rec.replace("/", "_")
            figs.append(
                figures.layer_head_map(
                    aggregate.certificate_map(r.telemetry),
                    out / f"heatmap_{safe}.png",
                    f"{rec}: mean certified TV bound per layer × head",
                    "TV bound",
                )
            )
            figs.append(
                figures.layer_head_map(
                    aggregate.saturation_map(r.telemetry),
                    out / f"saturation_{safe}.png",
                    f"{rec}: fraction of saturated cells (meter ≥ 1)",
                    "fraction",
                )
            )
    variants = results["variants"]
    baseline = variants[DENSE]["accuracy"]["value"]
    points = [
        figures.AccuracyPoint(
            r.label,
            variants[r.label]["accuracy"]["value"],
            variants[r.label]["ci95_low"]["value"],
            variants[r.label]["ci95_high"]["value"],
            variants[r.label]["bytes_per_token_effective"]["value"],
            r.gated,
        )
        for r in compressed
    ]
    if points:
        figs.append(figures.accuracy_bars(points, baseline, out / "accuracy.png"))
        dense_bytes = variants[compressed[0].label]["bytes_per_token_fp16"]["value"]
        placed = [p for p in points if p.bytes_per_token is not None]   # None: no read, no effective bytes
        if placed:
            figs.append(figures.bytes_vs_accuracy(placed, dense_bytes, baseline, out / "bytes_vs_accuracy.png"))
    return figs


def write_report(
    result: WorkloadResult,
    out: Path,
    name: str,
    command: str,
    config: dict[str, Any],
    seed: int,
    resamples: int,
    volatile: dict[str, Any],
    title: str,
) -> tuple[Path, Path, ReportTable]:
    """Write results.json, the PNGs and report.html into ``out``; return (json, html, summary table)."""
    out.mkdir(parents=True, exist_ok=True)
    results = results_section(result, seed, resamples)
    table = summary_table(results)
    figs = _figures(result, results, out)
    doc = build_document(name, config, results, seed, volatile, command.split())
    json_path = write_results(out / "results.json", doc)
    gates = "; ".join(f"{k}: {v['gate']}" for k, v in result.gate_choice.items())
    paras = [
        f"{len(result.samples)} RULER samples, model {config.get('model')}, context {config.get('context')}.",
        f"Gates used: {gates or 'none'}.",
        "Every number in results.json carries its tier (certified / partial / empirical).",
    ]
    html_path = write_html(out / "report.html", title, paras, [table], figs, command)
    return json_path, html_path, table
