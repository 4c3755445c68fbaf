"""Turn a :class:`~kvcert.cli.workload.WorkloadResult` into results.json, PNGs, report.html and a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcert.cache.telemetry import Telemetry
from kvcert.cli.workload import DENSE, VariantRecord, WorkloadResult
from kvcert.eval.stats import mcnemar, paired_bootstrap
from kvcert.report import aggregate, figures
from kvcert.report.html import write_html
from kvcert.report.results import CERTIFIED, EMPIRICAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, fmt

COVERAGE_TAU = 0.2
MB = 1e6


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired_vs_dense(dense: list[float], scores: list[float], seed: int, resamples: int) -> dict[str, Any]:
    """A variant's paired statistics against dense on the same samples, tiered empirical: the percentile bootstrap
    of ``mean(scores) − mean(dense)`` (difference, 95 % CI, resamples) and the exact McNemar p of the two runs'
    full-score outcomes (``score >= 1``)."""
    boot = paired_bootstrap(dense, scores, resamples=resamples, seed=seed)
    mc = mcnemar([s >= 1.0 for s in dense], [s >= 1.0 for s in scores])
    return {
        "diff_vs_dense": tiered(boot.diff, EMPIRICAL),
        "ci95_low": tiered(boot.low, EMPIRICAL),
        "ci95_high": tiered(boot.high, EMPIRICAL),
        "mcnemar_p": tiered(mc.p_exact, EMPIRICAL),
        "bootstrap_resamples": tiered(boot.resamples, EMPIRICAL),
    }


def variant_numbers(rec: VariantRecord, dense: VariantRecord, seed: int, resamples: int) -> dict[str, Any]:
    """Tiered numbers of one variant: accuracy and paired stats vs dense (empirical, :func:`paired_vs_dense`), meter
    (certified), bytes / page-in / fallback (empirical measurements)."""
    out: dict[str, Any] = {
        "accuracy": tiered(_mean(rec.scores), EMPIRICAL),
        "samples": tiered(len(rec.scores), EMPIRICAL),
    }
    if rec.label != DENSE:
        out.update(paired_vs_dense(dense.scores, rec.scores, seed, resamples))
    tels = rec.telemetry
    if tels:
        fallback = aggregate.pooled(tels, lambda t: t.fallback_rate)
        out.update({k: tiered(v, EMPIRICAL) for k, v in aggregate.byte_numbers(tels).items()})  # measured
        out.update(
            {
                "fallback_rate": tiered(fallback, EMPIRICAL),
                "coverage_q@0.2": tiered(
                    aggregate.pooled(tels, lambda t: t.coverage(COVERAGE_TAU, "q_head")), CERTIFIED
                ),
                "coverage_kv@0.2": tiered(
                    aggregate.pooled(tels, lambda t: t.coverage(COVERAGE_TAU, "kv_head")), CERTIFIED
                ),
                "informative_fraction": tiered(aggregate.pooled(tels, lambda t: t.informative_fraction), CERTIFIED),
                "value_term_p90": tiered(aggregate.quantile(tels, "value_term", 0.9), CERTIFIED),
                "max_certificate": tiered(  # samples with no cell (NaN) do not count, in any order
                    max((m for t in tels if (m := t.max_certificate) == m), default=None), CERTIFIED
                ),
                "cells": tiered(sum(t.cells for t in tels), EMPIRICAL),
                "fail_closed": tiered(sum(t.fail_closed for t in tels), EMPIRICAL),
            }
        )
        if all(t.violations is not None for t in tels):  # validate mode
            out["violations"] = tiered(sum(t.violations or 0 for t in tels), EMPIRICAL)
        if tels[0].tier_b_reads is not None:
            out.update(tier_b_gate_numbers(tels))
        if tels[0].resident_fraction is not None:
            out.update(resident_numbers(tels))
    return out


def tier_b_gate_numbers(tels: list[Telemetry]) -> dict[str, Any]:
    """A Tier-B gate's numbers: the share of KV-head reads it served on the partially certified bound alone and the
    cells charged (measured), the most δ any request spent on them (its budget's accounting), and in validate mode the
    cells of those reads whose exact TV exceeded the partial bound (measured)."""
    out = {
        "tier_b_read_share": tiered(aggregate.pooled(tels, lambda t: t.tier_b_read_share), EMPIRICAL),
        "tier_b_cells": tiered(sum(t.tier_b_cells for t in tels), EMPIRICAL),
        "tier_b_delta_spent_max": tiered(max(t.tier_b_delta_spent or 0.0 for t in tels), EMPIRICAL),
    }
    if tels[0].true_tv is not None:
        out["partial_violations"] = tiered(sum(t.partial_violations for t in tels), EMPIRICAL)
    return out


def _max_cell(tels: list[Telemetry], attr: str) -> float | None:
    """Largest non-NaN cell of the resident tensor ``attr`` (``[steps, layers, B, Hq]`` over every forward step,
    NaN where no resident read happened) over the samples (``None``: no such cell)."""
    vals = [v[~v.isnan()] for t in tels if (v := getattr(t, attr)) is not None]
    found = [float(v.max()) for v in vals if v.numel()]
    return max(found) if found else None


def resident_reads_above(tels: list[Telemetry], attr: str, tau: float) -> tuple[int, int]:
    """``(reads, above)`` over the samples: KV-head reads with a resident read (a non-NaN cell of the resident tensor
    ``attr``, ``[steps, layers, B, Hq]``) and those whose worst query head exceeds ``tau``. A KV head recalls when
    any query head of its group is above ``tau``, so this counts the reads the omitted mass alone sends to recall
    (``omitted_mass_bound``: with the certified bound; ``omitted_mass``: even with an exact one)."""
    reads = above = 0
    for t in tels:
        v = getattr(t, attr)
        if v is None:
            continue
        grouped = v.unflatten(-1, (-1, t.group_size))  # [steps, layers, B, Hkv, G]
        seen = ~grouped.isnan().all(-1)
        worst = grouped.nan_to_num(nan=-1.0).amax(-1)
        reads += int(seen.sum())
        above += int((seen & (worst > tau)).sum())
    return reads, above


def context_ratios(
    fp16: float | None, device: float | None, paged: float | None, recalled: float | None, fp16_token: float
) -> dict[str, Any]:
    """A resident variant's byte figures against its whole contexts (resident and omitted tokens), tiered empirical
    (measured), from the sums over its samples of ``bytes_fp16_context`` (``fp16``), ``bytes_device``,
    ``page_in_bytes`` (``paged``) and ``bytes_recalled`` and the fp16 bytes of one token: ``capacity_context =
    fp16 / device``, ``bytes_per_token_device_context = fp16_token · device / fp16``, ``page_in_ratio_context =
    paged / fp16``, ``recall_ratio = recalled / fp16``; NaN where a denominator is 0 or missing, or a numerator
    missing."""

    def ratio(num: float | None, den: float | None) -> float:
        return num / den if num is not None and den else float("nan")

    return {
        "capacity_context": tiered(ratio(fp16, device), EMPIRICAL),
        "bytes_per_token_device_context": tiered(
            ratio(None if device is None else fp16_token * device, fp16), EMPIRICAL
        ),
        "page_in_ratio_context": tiered(ratio(paged, fp16), EMPIRICAL),
        "recall_ratio": tiered(ratio(recalled, fp16), EMPIRICAL),
    }


def resident_numbers(tels: list[Telemetry]) -> dict[str, Any]:
    """Tiered resident-set numbers of a variant (``docs/cli.md#resident-variants``): mean resident fraction over
    the samples, the largest omitted-mass bound of any cell (certified), pages / bytes recalled (and the keys' part of
    them: key-first recall pages in keys to tighten the bound, values to serve) and summary bytes (sums, measured),
    the fp16 K/V bytes of the whole contexts (resident and omitted tokens), device capacity, device bytes per token,
    page-in and recall traffic relative to them, and in validate mode the largest exact omitted mass, the recall
    violations (must be 0) and, with the gate on, the recall floor (``bytes_recall_floor``, also over the contexts'
    fp16 K/V: ``recall_floor_ratio``)."""
    fp16 = sum(t.bytes_fp16_context for t in tels)
    device = sum(t.bytes_device for t in tels)
    recalled = sum(t.bytes_recalled for t in tels)
    paged = sum(t.bytes_paged for t in tels)
    out = {
        "resident_fraction": tiered(_mean([float(t.resident_fraction or 0.0) for t in tels]), EMPIRICAL),
        "max_omitted_mass_bound": tiered(_max_cell(tels, "omitted_mass_bound"), CERTIFIED),
        "pages_recalled": tiered(sum(t.pages_recalled for t in tels), EMPIRICAL),
        "bytes_recalled": tiered(recalled, EMPIRICAL),
        "bytes_recalled_keys": tiered(sum(t.bytes_recalled_keys for t in tels), EMPIRICAL),
        "bytes_summary": tiered(sum(t.bytes_summary for t in tels), EMPIRICAL),
        "bytes_fp16_context": tiered(fp16, EMPIRICAL),
        "bytes_device_sliding": tiered(sum(t.bytes_device_sliding for t in tels), EMPIRICAL),
        **context_ratios(fp16, device, paged, recalled, aggregate.fp16_bytes_per_token(tels[0])),
    }
    reads, bound_above = resident_reads_above(tels, "omitted_mass_bound", COVERAGE_TAU)
    out["resident_reads"] = tiered(reads, EMPIRICAL)
    out["reads_mass_bound_above"] = tiered(bound_above, CERTIFIED)
    stats = [t.reselect for t in tels if t.reselect is not None]
    if stats:  # --reselect: what re-selection moved and paged in (sums, measured)
        out["reselections"] = tiered(sum(s.reselections for s in stats), EMPIRICAL)
        out["reselect_promoted"] = tiered(sum(s.promoted for s in stats), EMPIRICAL)
        out["reselect_bytes_paged"] = tiered(sum(s.bytes_paged for s in stats), EMPIRICAL)
    if tels[0].omitted_mass is not None:
        out["max_omitted_mass"] = tiered(_max_cell(tels, "omitted_mass"), EMPIRICAL)
        out["reads_mass_above"] = tiered(resident_reads_above(tels, "omitted_mass", COVERAGE_TAU)[1], EMPIRICAL)
        out["recall_violations"] = tiered(sum(t.recall_violations for t in tels), EMPIRICAL)
    floors = [t.bytes_recall_floor for t in tels if t.bytes_recall_floor is not None]
    if floors:  # validate mode with the gate on: the recall no sound bound could have saved
        out["bytes_recall_floor"] = tiered(sum(floors), EMPIRICAL)
        out["recall_floor_ratio"] = tiered(sum(floors) / fp16 if fp16 else float("nan"), EMPIRICAL)
    return out


def results_section(result: WorkloadResult, seed: int, resamples: int) -> dict[str, Any]:
    """The ``results`` part of results.json for a RULER workload."""
    dense = result.variant(DENSE)
    variants = {}
    for rec in result.variants:
        variants[rec.label] = {
            "gate": rec.gate.describe(),
            "codecs": None if rec.spec is None else {"keys": rec.spec.keys, "values": rec.spec.values},
            **(
                {}
                if rec.resident is None
                else {
                    "select": rec.resident.select,
                    "summary": rec.resident.summary,
                    "resident_alloc": rec.resident.alloc,
                    "recall": rec.resident.recall,
                }
            ),
            **variant_numbers(rec, dense, seed, resamples),
        }
    with_bytes = [r for r in result.variants if r.telemetry]
    if DENSE in variants and with_bytes:  # the dense row shows what an fp16 cache holds, to compare with
        variants[DENSE]["bytes_per_token_fp16"] = tiered(
            aggregate.fp16_bytes_per_token(with_bytes[0].telemetry[0]), EMPIRICAL
        )
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


def whole_context(v: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """``(device bytes per token, capacity, page-in ratio)`` of a variant's results entry ``v``, a resident variant's
    against its whole contexts (resident and omitted tokens, ``bytes_fp16_context``; its plain ``bytes_fp16`` counts
    the resident tokens only, so the plain columns would compare a 25 % resident set with a quarter of the context),
    any other's the plain ones (dense: fp16 bytes per token, capacity 1, no page-in)."""

    def val(key: str) -> Any:
        return v[key]["value"] if key in v else None

    if "capacity_context" in v:
        return val("bytes_per_token_device_context"), val("capacity_context"), val("page_in_ratio_context")
    fp16 = val("bytes_per_token_fp16")
    return (
        val("bytes_per_token_device") or fp16,
        val("capacity") or (1.0 if fp16 else None),
        val("page_in_ratio"),
    )


def summary_table(
    results: dict[str, Any], title: str = "RULER accuracy per scheme (paired against dense on the same samples)"
) -> ReportTable:
    """One row per variant: accuracy, paired CI vs dense, McNemar p, bytes, page-in, fallback, coverage; in validate
    mode also the violations (cells whose exact TV exceeded the certificate). ``kvcert eval`` and ``kvcert merge``
    print it with the same columns (a percentile, the value term's p90, does not pool across shards: ``–``)."""
    rows = []
    validated = any("violations" in v for v in results["variants"].values())
    for label, v in results["variants"].items():

        def val(key: str, v: dict[str, Any] = v) -> Any:
            return v[key]["value"] if key in v else None

        ci = "–" if val("ci95_low") is None else f"[{100 * val('ci95_low'):+.1f}, {100 * val('ci95_high'):+.1f}]"
        rows.append(
            (
                label,
                v["gate"],
                fmt(val("accuracy"), percent=True),
                ci,
                fmt(val("mcnemar_p"), 2),
                *(fmt(x, d) for x, d in zip(whole_context(v), (4, 3, 3), strict=True)),
                fmt(val("fallback_rate"), percent=True),
                fmt(val("coverage_kv@0.2"), percent=True),
                fmt(val("informative_fraction"), percent=True),
                fmt(val("value_term_p90"), 3),
                *((fmt(val("violations")),) if validated else ()),
            )
        )
    return ReportTable(
        title,
        (
            "scheme",
            "gate",
            "acc",
            "Δ CI95 (pp)",
            "McN p",
            "dev B/tok",
            "capacity",
            "page-in ×fp16",
            "fallbk",
            "cov@0.2",
            "inform",
            "value p90",
            *(("viol.",) if validated else ()),
        ),
        tuple(rows),
        "acc = RULER accuracy; Δ CI95 = paired bootstrap CI of acc − dense acc; McN p = exact McNemar p; "
        "dev B/tok = device-tier bytes per token at the end of the request, all layers (codes, scales, "
        "witnesses, exact entries, page summaries; dense: fp16 K/V); capacity = fp16 bytes / device bytes; "
        "page-in ×fp16 = page-in traffic over the request / its fp16 K/V bytes (bandwidth, apart from capacity); "
        "fallbk = share of KV-head reads served partly from an exact copy (paged in, or kept by a persistent repair); "
        "cov@0.2 = share of KV-head cells whose certified TV bound is <= 0.2; inform = share of cells with "
        "meter < 1; value p90 = 90th percentile over cells of the output bound's value term Σ_t p̃_t‖Δv_t‖ (output "
        "units: what the compressed values may move an output; no TV threshold covers it, only a gate's value_tol). "
        "Resident rows (+resident): bytes, capacity and page-in against the fp16 K/V of the whole "
        "context (resident and omitted tokens). "
        + ("viol. (validate mode) = cells whose exact TV exceeded the certificate (must be 0). " if validated else "")
        + "Tiers: acc, CI, p empirical; bytes, capacity, page-in, fallback measured (empirical); cov, inform and value "
        "p90 certified" + ("; viol. measured." if validated else "."),
    )


def tier_b_table(results: dict[str, Any]) -> ReportTable | None:
    """One row per variant under a Tier-B gate (``None`` when there is none): the share of its KV-head reads served on
    the partially certified bound alone, the cells charged, the most δ a request spent, and in validate mode the
    cells whose exact TV exceeded the partial bound."""
    rows = [
        (
            label,
            fmt(v["tier_b_read_share"]["value"], percent=True),
            fmt(v["tier_b_cells"]["value"]),
            fmt(v["tier_b_delta_spent_max"]["value"], 3),
            fmt(v["partial_violations"]["value"]) if "partial_violations" in v else "–",
        )
        for label, v in results["variants"].items()
        if "tier_b_read_share" in v
    ]
    if not rows:
        return None
    return ReportTable(
        "reads served on the Tier-B gate's partially certified bound",
        ("variant", "reads on Tier B", "cells charged", "max δ spent", "partial violations"),
        tuple(rows),
        "reads on Tier B = share of KV-head reads served unrepaired on the box over min(Tier A, Tier B) radii alone "
        "(partially certified: sound with probability >= 1 − δ_loc per charged cell, for queries independent of the "
        "dither); cells charged = cells whose certified bound was above τ, δ_loc each; max δ spent = the most any "
        "request spent (at most δ_req); partial violations = validate mode, cells of those reads whose exact TV "
        "exceeded the partial bound. Tiers: the share, cells, δ and violations measured (empirical); the reads "
        "themselves partially certified.",
    )


def resident_table(results: dict[str, Any]) -> ReportTable | None:
    """One row per resident variant (``None`` when there is none): resident fraction, largest omitted-mass bound,
    recall traffic, summary bytes, and in validate mode the exact omitted mass and the recall violations."""
    rows = []
    for label, v in results["variants"].items():
        if "resident_fraction" not in v:
            continue

        def val(key: str, v: dict[str, Any] = v) -> Any:
            return v[key]["value"] if key in v else None

        recalled, summary, reads = val("bytes_recalled"), val("bytes_summary"), val("resident_reads")
        sliding, context = val("bytes_device_sliding"), val("bytes_fp16_context")

        def share(key: str, reads: int | None = reads) -> str:
            n = val(key)
            return fmt(None if n is None or not reads else n / reads, percent=True)

        rows.append(
            (
                label,
                v.get("select", "–"),
                v["gate"],
                fmt(val("resident_fraction"), percent=True),
                fmt(val("capacity_context"), 2),
                fmt(context / sliding if sliding and context is not None else None, 3),
                fmt(val("max_omitted_mass_bound"), 3),
                fmt(val("max_omitted_mass"), 3),
                share("reads_mass_bound_above"),
                share("reads_mass_above"),
                fmt(val("pages_recalled")),
                fmt(None if recalled is None else recalled / MB, 3),
                fmt(val("recall_ratio"), 3),
                fmt(val("recall_floor_ratio"), 3),
                fmt(None if summary is None else summary / MB, 3),
                fmt(val("recall_violations")),
            )
        )
    if not rows:
        return None
    return ReportTable(
        "Resident variants: resident set, omitted attention mass and recall",
        (
            "variant",
            "select",
            "gate",
            "resident",
            "capacity",
            "ceiling",
            "max m̄ bound",
            "max m (exact)",
            "reads m̄>0.2",
            "reads m>0.2",
            "pages rec.",
            "MB rec.",
            "recall ×fp16",
            "floor ×fp16",
            "summary MB",
            "recall viol.",
        ),
        tuple(rows),
        "resident = share of written tokens held on the device (mean over samples); capacity = fp16 K/V bytes of the "
        "whole contexts (resident and omitted tokens) / device bytes (codes, witnesses, summaries, held pages); "
        "ceiling = the same fp16 K/V / the device bytes of the sliding-window layers alone (their windows in the "
        "scheme's codecs, which no resident fraction shrinks): no resident setting of that scheme exceeds it (– "
        "without sliding-window layers); max "
        "m̄ bound = largest certified bound on the attention mass of the non-resident tokens over all cells (before "
        "recall); max m (exact) = its exact value (validate mode only); reads m̄>0.2 / m>0.2 = share of the KV-head "
        "reads whose worst query head's omitted-mass bound / exact omitted mass (validate mode only) exceeds 0.2 "
        "before recall: the reads the omitted tokens alone send to recall at tau = 0.2, with the certified bound / "
        "even with an exact one; pages / MB rec. = pages whose keys were "
        "recalled from the host tier and the bytes recalled: their keys, and the values of the pages served "
        "(key-first recall; summed; a page held on the device by persistent recall counts once); recall "
        "×fp16 = recalled bytes / fp16 K/V bytes of the whole contexts, the denominator of the main table's page-in "
        "column, whose numerator adds the resident entries read exact and the dense fallbacks to the recalled bytes "
        "(both numerators in the host tier's dtype); floor ×fp16 = the recall floor over the same fp16 K/V: read by "
        "read, the fewest omitted tokens' K/V that any sound page-granular recall pages in (validate mode only; the "
        "part of the recall that no tighter bound could save); summary MB = device bytes of the page summaries; "
        "recall viol. = cells whose exact omitted mass exceeded its bound or whose true TV after recall exceeded "
        "the served certificate (validate mode; must be 0). "
        "Tiers: m̄ bound and reads m̄>0.2 certified; the rest measured (empirical).",
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
            whole_context(variants[r.label])[0],
            r.gated,
            r.resident is not None,
        )
        for r in compressed
    ]
    if points:
        figs.append(figures.accuracy_bars(points, baseline, out / "accuracy.png"))
        dense_bytes = variants[compressed[0].label]["bytes_per_token_fp16"]["value"]
        if any(p.bytes_per_token is not None for p in points):  # None: no read, no effective bytes
            figs.append(figures.bytes_vs_accuracy(points, dense_bytes, baseline, out / "bytes_vs_accuracy.png"))
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
) -> tuple[Path, Path, list[ReportTable]]:
    """Write results.json, the PNGs and report.html into ``out``; return (json, html, tables: the summary, then
    the resident variants' table when there are any)."""
    out.mkdir(parents=True, exist_ok=True)
    results = results_section(result, seed, resamples)
    tables = [summary_table(results)]
    tables += [t for t in (resident_table(results), tier_b_table(results)) if t is not None]
    figs = _figures(result, results, out)
    doc = build_document(name, config, results, seed, volatile, command.split())
    json_path = write_results(out / "results.json", doc)
    gates = "; ".join(f"{k}: {v['gate']}" for k, v in result.gate_choice.items())
    paras = [
        f"{len(result.samples)} RULER samples, model {config.get('model')}, context {config.get('context')}.",
        f"Gates used: {gates or 'none'}.",
        "Every number in results.json carries its tier (certified / partial / empirical).",
    ]
    if config.get("resident") is not None:
        paras.append(
            f"Resident variants ({', '.join(config.get('resident_schemes') or [])}): resident set "
            f"R = {config['resident']} chosen by {config.get('select')}, gate {config.get('resident_gate')}; "
            "every read certified against exact attention over all tokens, recall above tau."
        )
    html_path = write_html(out / "report.html", title, paras, tables, figs, command)
    return json_path, html_path, tables
