"""``kvcert merge``: pool sharded ``kvcert eval`` runs (disjoint samples, same schemes) into one result.

A long evaluation can be split by task across processes or machines; merging recomputes the paired
statistics on the concatenated per-sample scores, so the merged accuracy, paired bootstrap CI and McNemar p
are exactly those of one run over all samples. Telemetry-derived numbers are pooled from the shards:
page-in bytes, device and fp16 bytes, cells, fail-closed entries and violations are summed (capacity and the page-in
ratio are recomputed from the summed bytes), the maximum certificate is the maximum, and cell-weighted fractions
(coverage, informative fraction, fallback rate) are re-weighted by each shard's recorded cells — the same cell
weighting one run applies over its samples. Quantiles over cells (``value_term_p90``) are not merged: the quantile
of the union is not a function of the shards' quantiles. Stored bytes per token depend on each shard's token counts,
which a results file does not hold: they are reported per shard.
Resident variants (``--resident``): shards must share ``--resident`` and ``--select``; pages / bytes recalled,
summary bytes, recall violations and context fp16 bytes are summed, the omitted-mass maxima are the maximum, the
resident fraction is the sample-weighted mean (as one run's mean over samples), and the recall ratio and context
capacity are recomputed from the sums.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvcert.cli.common import ResamplesOption, command_line
from kvcert.cli.progress import progress_bar
from kvcert.cli.ruler_report import context_ratios, paired_vs_dense, resident_table, summary_table, tier_b_table
from kvcert.cli.validate import OverwriteOption, at_least, checked_inputs, prepare_out, seed_in_range
from kvcert.cli.workload import DENSE
from kvcert.report.figures import AccuracyPoint, accuracy_bars
from kvcert.report.html import write_html
from kvcert.report.results import (
    CERTIFIED,
    EMPIRICAL,
    build_document,
    check_document,
    load_json_object,
    tiered,
    write_results,
)
from kvcert.report.tables import print_table

SUMMED = (
    "page_in_bytes",
    "cells",
    "fail_closed",
    "violations",
    "bytes_device",
    "bytes_fp16",
    "pages_recalled",
    "bytes_recalled",
    "bytes_recalled_keys",
    "bytes_summary",
    "recall_violations",
    "bytes_recall_floor",
    "bytes_fp16_context",
    "bytes_device_sliding",
    "resident_reads",
    "reads_mass_bound_above",
    "reads_mass_above",
    "tier_b_cells",
    "partial_violations",
)
MAXED = {
    "max_certificate": CERTIFIED,
    "max_omitted_mass_bound": CERTIFIED,
    "max_omitted_mass": EMPIRICAL,
    "tier_b_delta_spent_max": EMPIRICAL,
}
CELL_WEIGHTED = {
    "coverage_q@0.2": CERTIFIED,
    "coverage_kv@0.2": CERTIFIED,
    "informative_fraction": CERTIFIED,
    "fallback_rate": EMPIRICAL,
    "tier_b_read_share": EMPIRICAL,
}
SAME_CONFIG = (
    "model",
    "context",
    "schemes",
    "gate",
    "max_new_tokens",
    "resident",
    "select",
    "summary",
    "resident_alloc",
    "recall",
    "reselect",
    "witness",
    "device_budget",
    "exact_sinks",
    "upgrade",
    "heavy_share",
    "heavy_values",
    "bands",
    "validate",
)  # the run's seed may differ: shards of other seeds hold other samples, each still paired within itself


def _value(node: dict[str, Any], key: str) -> Any:
    return node[key]["value"] if key in node else None


def load_shard(path: Path) -> dict[str, Any]:
    """Read one run's ``results.json`` (a run directory or the file), parsed and checked
    (:func:`kvcert.report.results.check_document`, then :func:`check_shard`); ``ValueError`` naming the problem."""
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no results.json")
    raw = load_json_object(file)
    results = raw.get("results")
    if raw.get("command") not in ("eval", "run") or not isinstance(results, dict) or "per_sample" not in results:
        raise ValueError(f"{file}: not a kvcert eval/run results file (need per-sample scores)")
    doc = check_document(raw, file)
    check_shard(doc.document, file)
    return doc.document


def _need(ok: bool, where: Path, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {what}")


def _is_number(leaf: Any, *, integer: bool = False) -> bool:
    if not isinstance(leaf, dict) or "value" not in leaf:
        return False
    v = leaf["value"]
    kinds = (int,) if integer else (int, float)
    return isinstance(v, kinds) and not isinstance(v, bool)


def check_shard(doc: dict[str, Any], where: Path) -> None:
    """Check every field :func:`merge_results` reads: ``config`` an object; ``results.variants`` an object of
    objects with a string ``gate`` (and, with telemetry, numeric or null tiered ``cells`` etc.);
    ``results.per_sample`` a list of ``{"task": str, "index": tiered int, "scores": {label: tiered number in
    [0, 1]}}`` with exactly the variant labels. ``ValueError`` naming the file and the first bad field."""
    _need(isinstance(doc.get("config"), dict), where, "'config' is not a JSON object")
    results = doc.get("results")
    if not isinstance(results, dict):
        raise ValueError(f"{where}: 'results' is not a JSON object")
    variants, per_sample = results.get("variants"), results.get("per_sample")
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{where}: results.variants is not a non-empty object")
    labels = set(variants)
    for lab, v in variants.items():
        _need(
            isinstance(v, dict) and isinstance(v.get("gate"), str) and "codecs" in v,
            where,
            f"results.variants[{lab!r}] needs a string 'gate' and 'codecs'",
        )
        if "cells" in v:
            for key in (*SUMMED, *CELL_WEIGHTED, *MAXED, "resident_fraction"):
                leaf = v.get(key)
                _need(
                    key not in v
                    or (
                        isinstance(leaf, dict)
                        and "value" in leaf
                        and (leaf["value"] is None or (_is_number(leaf) and (key not in SUMMED or leaf["value"] >= 0)))
                    ),
                    where,
                    f"results.variants[{lab!r}].{key} is not a tiered number (a count >= 0 if summed)",
                )
            _need(
                _is_number(v["cells"], integer=True) and v["cells"]["value"] >= 0,
                where,
                f"results.variants[{lab!r}].cells is not a tiered count >= 0",
            )
            for key in ("bytes_per_token_fp16", "bytes_per_token_stored"):
                _need(key in v, where, f"results.variants[{lab!r}] lacks {key}")
        if "bytes_per_token_fp16" in v:  # read by the byte figures and the table (dense: its device bytes)
            _need(
                _is_number(v["bytes_per_token_fp16"]) and v["bytes_per_token_fp16"]["value"] > 0,
                where,
                f"results.variants[{lab!r}].bytes_per_token_fp16 is not a tiered number > 0",
            )
    if not isinstance(per_sample, list) or not per_sample:
        raise ValueError(f"{where}: results.per_sample is not a non-empty list")
    for i, s in enumerate(per_sample):
        at = f"results.per_sample[{i}]"
        _need(isinstance(s, dict) and isinstance(s.get("task"), str), where, f"{at} needs a string 'task'")
        _need(_is_number(s.get("index"), integer=True), where, f"{at}.index is not a tiered integer")
        scores = s.get("scores")
        _need(
            isinstance(scores, dict) and set(scores) == labels,
            where,
            f"{at}.scores must hold exactly the variants {sorted(labels)}",
        )
        for lab, leaf in scores.items():
            _need(
                _is_number(leaf) and 0.0 <= leaf["value"] <= 1.0,
                where,
                f"{at}.scores[{lab!r}] is not a tiered score in [0, 1]",
            )


def _check_compatible(docs: list[dict[str, Any]], paths: list[Path]) -> list[str]:
    """Variant labels shared by every shard, with the same gate and the same :data:`SAME_CONFIG` fields;
    samples must be disjoint."""
    first = docs[0]["results"]["variants"]
    labels = list(first)
    seen: dict[tuple[str, int], Path] = {}
    for doc, path in zip(docs, paths, strict=True):
        check_shard(doc, path)
        variants = doc["results"]["variants"]
        if list(variants) != labels:
            raise ValueError(f"{path}: variants {list(variants)} differ from {labels}")
        for lab in labels:
            if variants[lab]["gate"] != first[lab]["gate"]:
                raise ValueError(
                    f"{path}: variant {lab!r} ran gate {variants[lab]['gate']!r}, "
                    f"another shard ran {first[lab]['gate']!r}"
                )
        for key in SAME_CONFIG:
            mine, theirs = doc["config"].get(key), docs[0]["config"].get(key)
            if mine != theirs:
                raise ValueError(
                    f"{path}: {key} {mine!r} differs from the first shard's ({theirs!r}); "
                    "shards must share model, context, schemes, gate, max_new_tokens, resident, select, "
                    "summary and resident_alloc"
                )
        for s in doc["results"]["per_sample"]:
            sample = (s["task"], s["index"]["value"])
            if sample in seen:
                raise ValueError(f"sample {sample} appears in both {seen[sample]} and {path}: shards must be disjoint")
            seen[sample] = path
    if DENSE not in labels:
        raise ValueError(f"the shards hold no {DENSE!r} baseline")
    return labels


def _pool_bytes(out: dict[str, Any], parts: list[dict[str, Any]]) -> None:
    """Add to a merged variant ``out`` (its summed byte counts already in) the byte figures one run derives from
    them (:func:`kvcert.report.aggregate.byte_numbers`): capacity ``Σ fp16 / Σ device bytes``, device bytes per
    token, page-in ratio ``Σ page-in / Σ fp16``; all empirical (bytes measured)."""
    out["bytes_per_token_fp16"] = parts[0]["bytes_per_token_fp16"]
    out["bytes_per_token_stored_per_shard"] = [p["bytes_per_token_stored"] for p in parts]
    if "bytes_device" in out and _value(out, "bytes_device"):
        out["capacity"] = tiered(_value(out, "bytes_fp16") / _value(out, "bytes_device"), EMPIRICAL)
        out["bytes_per_token_device"] = tiered(_value(out, "bytes_per_token_fp16") / _value(out, "capacity"), EMPIRICAL)
    paged, fp16 = _value(out, "page_in_bytes"), _value(out, "bytes_fp16")
    if paged is not None and fp16:
        out["page_in_ratio"] = tiered(paged / fp16, EMPIRICAL)


def merge_results(docs: list[dict[str, Any]], paths: list[Path], seed: int, resamples: int) -> dict[str, Any]:
    """The merged ``results`` section (every number tiered)."""
    labels = _check_compatible(docs, paths)
    per_sample = [s for d in docs for s in d["results"]["per_sample"]]
    scores = {lab: [float(s["scores"][lab]["value"]) for s in per_sample] for lab in labels}
    variants: dict[str, Any] = {}
    for lab in labels:
        parts = [d["results"]["variants"][lab] for d in docs]
        out: dict[str, Any] = {
            "gate": parts[0]["gate"],
            "codecs": parts[0]["codecs"],
            **({"select": parts[0]["select"]} if "select" in parts[0] else {}),
            "accuracy": tiered(sum(scores[lab]) / len(scores[lab]), EMPIRICAL),
            "samples": tiered(len(scores[lab]), EMPIRICAL),
        }
        if lab != DENSE:
            out.update(paired_vs_dense(scores[DENSE], scores[lab], seed, resamples))
        if "cells" in parts[0]:
            for key in SUMMED:
                if all(key in p for p in parts):
                    counts = [_value(p, key) for p in parts]
                    tiers = {p[key]["tier"] for p in parts}  # the producing code's (certified: counts of bounds)
                    if len(tiers) > 1:
                        raise ValueError(f"results of {lab!r}: {key} has the tiers {sorted(tiers)} across runs")
                    (tier,) = tiers
                    out[key] = tiered(None if None in counts else sum(counts), tier)
            cells = [_value(p, "cells") for p in parts]
            for key, tier in CELL_WEIGHTED.items():
                if not any(key in p for p in parts):  # a Tier-B gate's share: only its variants have it
                    continue
                pairs = [
                    (_value(p, key), c)
                    for p, c in zip(parts, cells, strict=True)
                    if _value(p, key) is not None and _value(p, key) == _value(p, key) and c
                ]
                den = sum(c for _, c in pairs)
                out[key] = tiered(sum(v * c for v, c in pairs) / den if den else float("nan"), tier)
            for key, tier in MAXED.items():
                if any(key in p for p in parts):
                    maxima = [m for p in parts if (m := _value(p, key)) is not None]
                    out[key] = tiered(max(maxima) if maxima else None, tier)
            if all("resident_fraction" in p for p in parts):  # one run: the mean over its samples
                n = [len(d["results"]["per_sample"]) for d in docs]
                fractions = [_value(p, "resident_fraction") for p in parts]
                out["resident_fraction"] = tiered(
                    sum(f * k for f, k in zip(fractions, n, strict=True)) / sum(n) if None not in fractions else None,
                    EMPIRICAL,
                )
                out.update(
                    context_ratios(
                        _value(out, "bytes_fp16_context"),
                        _value(out, "bytes_device"),
                        _value(out, "page_in_bytes"),
                        _value(out, "bytes_recalled"),
                        _value(parts[0], "bytes_per_token_fp16"),
                    )
                )
                floor, context = out.get("bytes_recall_floor"), _value(out, "bytes_fp16_context")
                if floor is not None and floor["value"] is not None and context:  # validate mode, gate on
                    out["recall_floor_ratio"] = tiered(floor["value"] / context, EMPIRICAL)
            _pool_bytes(out, parts)
        elif "bytes_per_token_fp16" in parts[0]:  # dense: its fp16 bytes are its device bytes
            out["bytes_per_token_fp16"] = parts[0]["bytes_per_token_fp16"]
        variants[lab] = out
    return {"variants": variants, "shards": [str(p) for p in paths], "per_sample": per_sample}


def merge(
    runs: Annotated[list[Path], typer.Argument(help="run directories (or results.json files) of `kvcert eval`")],
    out: Annotated[Path, typer.Option(help="directory for the merged results.json, report.html and PNG")],
    seed: Annotated[int, typer.Option(help="bootstrap seed")] = 0,
    resamples: ResamplesOption = 10_000,
    overwrite: OverwriteOption = False,
) -> None:
    """Merge sharded `kvcert eval` runs: paired CI and McNemar recomputed on all samples together."""
    console = Console()
    with checked_inputs("merge"):
        at_least("resamples", resamples, 1)
        seed_in_range(seed)
        docs = []
        with progress_bar("reading shards", len(runs), console) as tick:
            for i, path in enumerate(runs):
                docs.append(load_shard(path))
                tick(i)
        merged = merge_results(docs, runs, seed, resamples)
        prepare_out(out, overwrite, inputs=[p / "results.json" if p.is_dir() else p for p in runs])
    n = _value(merged["variants"][DENSE], "samples")
    title = f"merged accuracy vs dense, paired over all {n} samples of {len(merged['shards'])} shard(s)"
    tables = [summary_table(merged, title)]
    tables += [t for t in (resident_table(merged), tier_b_table(merged)) if t is not None]
    dense = _value(merged["variants"][DENSE], "accuracy")
    points = [
        AccuracyPoint(
            lab, _value(v, "accuracy"), _value(v, "ci95_low"), _value(v, "ci95_high"), float("nan"), v["gate"] != "off"
        )
        for lab, v in merged["variants"].items()
        if lab != DENSE
    ]
    png = accuracy_bars(points, dense, out / "accuracy.png")
    config = {"shards": [d["config"] for d in docs], "resamples": resamples}
    doc = build_document(
        "merge",
        config,
        merged,
        seed,
        {"merged_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        command_line().split(),
    )
    json_path = write_results(out / "results.json", doc)
    html = write_html(
        out / "report.html",
        "kvcert merge",
        [__doc__.split("\n\n")[1].replace("\n", " ")],
        tables,
        [png],
        command_line(),
    )
    for table in tables:
        print_table(console, table)
    console.print(f"results: {json_path}\nreport:  {html}")
