"""``kvcert frontier``: RULER accuracy against device bytes for every scheme raw and gated, with peer caches.

Every sample is decoded by dense, each scheme raw and gated (the ``kvcert eval`` workload, paired on one
exact prefill) and each peer — transformers' ``QuantizedCache`` (quanto int4 / int2 with its residual
window, :mod:`kvcert.eval.peers`) — from the same exact prefill of the same prompt. Accuracy and its paired
bootstrap CI against dense are empirical; device bytes per token are measured at the end of each request
(kvcert: ``Telemetry.bytes_device``; peers: the tensors the cache holds); page-in traffic is reported apart.
Writes results.json, frontier.png (accuracy vs device bytes) and report.html.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvcert.cache.gate import Gate
from kvcert.cli.common import (
    DEFAULT_SCHEMES,
    AllocationOption,
    BandsOption,
    ContextOption,
    DeviceBudgetOption,
    ExactSinksOption,
    GateOption,
    HeavyShareOption,
    HeavyValuesOption,
    MaxNewTokensOption,
    ModelOption,
    RecallOption,
    ResamplesOption,
    ReselectOption,
    ResidentAllocOption,
    ResidentOption,
    ResidentSettings,
    SamplesOption,
    SchemesOption,
    SeedOption,
    SelectOption,
    StorageOptions,
    SummaryOption,
    TasksOption,
    UpgradeOption,
    ValidateOption,
    WitnessOption,
    command_line,
    default_out,
    load_model,
    ruler_variants,
    schemes_fit,
    set_seed,
    task_names,
)
from kvcert.cli.progress import progress_bar
from kvcert.cli.ruler_command import check_ruler_inputs, exit_on_violations
from kvcert.cli.ruler_report import results_section, variant_numbers, whole_context
from kvcert.cli.validate import (
    OverwriteOption,
    at_least,
    checked_inputs,
    loaded_context_fits,
)
from kvcert.cli.workload import DENSE, VariantRecord, WorkloadResult, run_workload
from kvcert.eval import ruler
from kvcert.eval.harness import decode_text, prompt_ids
from kvcert.eval.peers import PeerResult, parse_peers, run_peers
from kvcert.report import figures
from kvcert.report.html import write_html
from kvcert.report.results import EMPIRICAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, fmt, print_table

PEER_KIND, RESIDENT_KIND, DEFAULT_PEERS = "peer", "resident", "quanto-int4,quanto-int2,fp8-e4m3"


def peer_numbers(
    rec: VariantRecord, dense: VariantRecord, runs: list[PeerResult], fp16_token: float, seed: int, resamples: int
) -> dict[str, Any]:
    """Tiered numbers of one peer: accuracy and paired stats vs dense (empirical), device bytes (measured)."""
    device = sum(r.bytes_device for r in runs)
    fp16 = sum(r.bytes_fp16 for r in runs)
    return {
        "gate": "none (peer)",
        "kind": PEER_KIND,
        **variant_numbers(rec, dense, seed, resamples),
        "bytes_per_token_device": tiered(fp16_token * device / fp16, EMPIRICAL),
        "bytes_per_token_fp16": tiered(fp16_token, EMPIRICAL),
        "capacity": tiered(fp16 / device, EMPIRICAL),
        "bytes_device": tiered(device, EMPIRICAL),
        "bytes_fp16": tiered(fp16, EMPIRICAL),
        "page_in_ratio": tiered(0.0, EMPIRICAL),
    }


def frontier_table(variants: dict[str, Any]) -> ReportTable:
    """One row per variant, sorted by device bytes per token (dense at its fp16 bytes; a resident variant's device
    bytes, capacity and page-in against its whole contexts, :func:`~kvcert.cli.ruler_report.whole_context`)."""

    def val(v: dict[str, Any], key: str) -> Any:
        return v[key]["value"] if key in v else None

    def dev(v: dict[str, Any]) -> float:
        return whole_context(v)[0] or float("inf")

    rows = []
    validated = any("violations" in v for v in variants.values())
    for label, v in sorted(variants.items(), key=lambda kv: dev(kv[1])):
        low, high = val(v, "ci95_low"), val(v, "ci95_high")
        ci = "–" if low is None else f"[{100 * low:+.1f}, {100 * high:+.1f}]"
        per_token, capacity, page_in = whole_context(v)
        rows.append(
            (
                label,
                v["kind"],
                v["gate"],
                fmt(val(v, "accuracy"), percent=True),
                ci,
                fmt(per_token, 4),
                fmt(capacity, 2),
                fmt(page_in, 3),
                fmt(val(v, "coverage_kv@0.2"), percent=True),
                *((fmt(val(v, "violations")),) if validated else ()),
            )
        )
    columns = ("variant", "kind", "gate", "acc", "Δ CI95 (pp)", "dev B/tok", "capacity", "page-in ×fp16", "cov@0.2")
    return ReportTable(
        "accuracy vs device bytes (paired against dense on the same samples)",
        (*columns, *(("viol.",) if validated else ())),
        tuple(rows),
        "dev B/tok = bytes resident on the device tier per token at the end of the request, all layers (kvcert: "
        "codes, scales, witnesses, exact entries; peers: quantized states + residual window; dense: fp16 K/V); "
        "capacity = fp16 / device bytes; page-in ×fp16 = host page-in traffic / fp16 K/V bytes. Resident rows "
        "(kind resident, +resident): device bytes, capacity and page-in against the fp16 K/V of the whole context "
        "(resident and omitted tokens; device bytes include the summaries of the omitted keys). Tiers: acc, CI "
        "empirical; bytes, capacity, page-in measured (empirical); cov@0.2 certified."
        + (
            " viol. (--validate) = cells whose exact TV exceeded the certificate (must be 0; measured)."
            if validated
            else ""
        ),
    )


def frontier(
    tasks: TasksOption = "niah_single_1,niah_multikey_1",
    context: ContextOption = 2048,
    samples: SamplesOption = 2,
    schemes: SchemesOption = DEFAULT_SCHEMES,
    gate: GateOption = "auto",
    peers: Annotated[
        str, typer.Option(help="comma-separated peers: quanto-int4, quanto-int2, fp8-e4m3 (or '')")
    ] = DEFAULT_PEERS,
    residual_length: Annotated[int, typer.Option(help="peers' full-precision residual window")] = 128,
    model: ModelOption = "smollm2-135m",
    seed: SeedOption = 0,
    max_new_tokens: MaxNewTokensOption = None,
    resamples: ResamplesOption = 10_000,
    out: Annotated[Path | None, typer.Option(help="report directory (default runs/frontier-<timestamp>)")] = None,
    overwrite: OverwriteOption = False,
    witness: WitnessOption = "log8",
    device_budget: DeviceBudgetOption = "1.0",
    exact_sinks: ExactSinksOption = 0,
    upgrade: UpgradeOption = None,
    heavy_share: HeavyShareOption = None,
    heavy_values: HeavyValuesOption = None,
    bands: BandsOption = 8,
    resident: ResidentOption = None,
    select: SelectOption = None,
    reselect: ReselectOption = None,
    summary: SummaryOption = None,
    resident_alloc: ResidentAllocOption = None,
    recall: RecallOption = None,
    validate: ValidateOption = False,
    allocation: AllocationOption = None,
) -> None:
    """Accuracy vs device bytes per token for every scheme raw and gated (and an allocation's with --allocation,
    resident with --resident, as in kvcert eval) and for peer caches (transformers' QuantizedCache), all on the
    same samples: table, frontier.png and report.html."""
    out = out or default_out("frontier")
    with checked_inputs("frontier"):
        task_list = task_names(tasks)
        settings = ResidentSettings(resident, select, reselect, summary, resident_alloc, recall)
        storage = StorageOptions(witness, device_budget, exact_sinks, upgrade, heavy_share, bands, heavy_values)
        variants = ruler_variants(schemes, storage, allocation, gate, settings)
        specs, chosen, plan = list(variants.specs), variants.gate, variants.plan
        peer_specs = parse_peers(peers, residual_length)
        at_least("residual-length", residual_length, 0)
        positions = check_ruler_inputs(
            model, task_list, context, plan, samples, resamples, seed, max_new_tokens, out, overwrite
        )
    console, t0 = Console(), time.time()
    set_seed(seed)
    loaded = load_model(model, seed)
    with checked_inputs("frontier"):
        loaded_context_fits(context, positions, loaded.model)
        schemes_fit(specs, loaded.model)
        for p in peer_specs:  # before any decoding: a peer that cannot hold this model stops the run now
            try:
                p.build(loaded.model)
            except ImportError as err:
                raise ValueError(str(err)) from None
    data = [s for t in task_list for s in ruler.load_task(t, context, samples, seed, loaded.tokenizer_dir)]
    n_var = 1 + 2 * len(specs) + (0 if plan is None else len(plan.specs))
    with progress_bar(f"decoding {len(data)} samples × {n_var} variants", len(data), console) as tick:
        result = run_workload(
            loaded, data, specs, chosen, seed, max_new_tokens, validate=validate, on_sample=tick, resident=plan
        )
    peer_recs = {p.label: VariantRecord(p.label, None, Gate.off()) for p in peer_specs}
    peer_runs: dict[str, list[PeerResult]] = {p.label: [] for p in peer_specs}
    with progress_bar(f"decoding {len(data)} samples × {len(peer_specs)} peers", len(data), console) as tick:
        for i, sample in enumerate(data):
            budget = sample.max_new_tokens if max_new_tokens is None else min(max_new_tokens, sample.max_new_tokens)
            for res in run_peers(
                loaded.model, prompt_ids(loaded.tokenizer, sample), peer_specs, budget, loaded.eos_ids
            ):
                text = decode_text(loaded.tokenizer, res.tokens)
                peer_recs[res.spec.label].predictions.append(text)
                peer_recs[res.spec.label].scores.append(ruler.score(sample, text))
                peer_runs[res.spec.label].append(res)
            tick(i)
    results = frontier_results(result, peer_recs, peer_runs, seed, resamples)
    config = {
        "model": model,
        "tasks": list(task_list),
        "context": context,
        "samples": samples,
        "schemes": [s.label for s in specs],
        "witness": witness,
        "device_budget": device_budget,
        "exact_sinks": exact_sinks,
        "upgrade": upgrade,
        "heavy_share": heavy_share,
        "heavy_values": heavy_values,
        "bands": bands,
        "gate": gate,
        "peers": [p.label for p in peer_specs],
        "residual_length": residual_length,
        "resident": resident,
        "select": None if plan is None else plan.select,
        "reselect": reselect,
        "summary": None if plan is None else plan.summary,
        "resident_alloc": None if plan is None else plan.alloc,
        "recall": None if plan is None else plan.recall,
        "resident_gate": None if plan is None else plan.gate.describe(),
        "validate": validate,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "bootstrap_resamples": resamples,
        "out": str(out),
    }
    table = frontier_table(results["variants"])
    png = frontier_figure(results, out / "frontier.png")
    doc = build_document("frontier", config, results, seed, {"seconds": time.time() - t0}, command_line().split())
    json_path = write_results(out / "results.json", doc)
    html = write_html(
        out / "report.html",
        f"kvcert frontier: {model}",
        [
            f"{len(data)} RULER samples ({', '.join(task_list)}) at {context} tokens, model {model}; "
            f"peers decode from the same exact prefill."
            + (
                ""
                if plan is None
                else f" Resident variants: R = {resident} chosen by {plan.select}, summary {plan.summary}, "
                f"split {plan.alloc}, recall {plan.recall}, gate {plan.gate.describe()}; their bytes, capacity and "
                "page-in are against the whole context."
            )
        ],
        [table],
        [png],
        command_line(),
    )
    print_table(console, table)
    console.print(f"results: {json_path}\nreport: [bold]{html}[/]")
    exit_on_violations(result, console)


def frontier_results(
    result: WorkloadResult,
    peer_recs: dict[str, VariantRecord],
    peer_runs: dict[str, list[PeerResult]],
    seed: int,
    resamples: int,
) -> dict[str, Any]:
    """``results`` of results.json: the eval workload's variants (each with its ``kind``) and the peers."""
    results = results_section(result, seed, resamples)
    for rec in result.variants:
        kind = RESIDENT_KIND if rec.resident is not None else ("gated" if rec.gated else "raw")
        results["variants"][rec.label]["kind"] = DENSE if rec.label == DENSE else kind
    dense = result.variant(DENSE)
    fp16_token = results["variants"][DENSE].get("bytes_per_token_fp16", {}).get("value")
    for label, rec in peer_recs.items():
        if fp16_token is None:
            raise ValueError("peers need at least one kvcert scheme to measure the fp16 bytes per token")
        results["variants"][label] = peer_numbers(rec, dense, peer_runs[label], fp16_token, seed, resamples)
        for i, entry in enumerate(results["per_sample"]):
            entry["scores"][label] = tiered(rec.scores[i], EMPIRICAL)
            entry["predictions"][label] = rec.predictions[i]
    return results


def frontier_points(results: dict[str, Any]) -> list[figures.AccuracyPoint]:
    """The plotted points: every variant but dense at its device bytes per token (a resident variant's against its
    whole contexts, flagged ``resident``; peers with ``gated=None``)."""
    return [
        figures.AccuracyPoint(
            label,
            v["accuracy"]["value"],
            v["ci95_low"]["value"],
            v["ci95_high"]["value"],
            whole_context(v)[0],
            None if v["kind"] == PEER_KIND else v["gate"] != "off",
            v["kind"] == RESIDENT_KIND,
        )
        for label, v in results["variants"].items()
        if label != DENSE
    ]


def frontier_figure(results: dict[str, Any], path: Path) -> Path:
    """Accuracy vs device bytes per token: raw red, gated green, resident purple diamonds, peers blue, dense starred
    at fp16."""
    dense = results["variants"][DENSE]
    return figures.bytes_vs_accuracy(
        frontier_points(results), dense["bytes_per_token_fp16"]["value"], dense["accuracy"]["value"], path
    )
