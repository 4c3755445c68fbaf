"""Question: which certified scheme reaches capacity >= 3x (device bytes <= 1/3 of fp16) at dense RULER accuracy?

Every sample is prefilled once exactly; dense, each scheme raw and each scheme gated (and, with ``--resident``,
each resident variant) then decode greedily from that prefill (:func:`kvcert.eval.branching.run_branches`), so
every comparison is paired on identical prompts. Per variant it reports (pooled over the samples, as
``kvcert eval`` does, :mod:`kvcert.cli.ruler_report`):

* RULER accuracy and the paired bootstrap 95% CI of (variant − dense) and the exact McNemar p (empirical);
* device bytes per token (``Telemetry.bytes_device``: codes, scales, witnesses, exact entries, page summaries,
  held pages; measured) and capacity = fp16 bytes / device bytes;
* page-in traffic over the request and per decode step, each over the request's fp16 K/V bytes (bandwidth, apart
  from capacity; measured), and for a resident variant the recalled bytes per decode step;
* the informative fraction (cells whose unclipped meter < 1) and KV-head coverage at τ = 0.2 (certified);
* with ``--validate``: every cell's exact TV next to its certificate, and the violations (must be 0); resident
  variants add the recall violations (exact omitted mass above its bound, or post-recall TV above the
  certificate).

Every byte figure of the capacity table divides by the fp16 K/V of *every* token the request wrote: for a
resident variant that is the whole context, resident and omitted tokens (``Telemetry.bytes_fp16_context``), not
its ``bytes_fp16``, which counts the resident tokens only.

Resident variants (``--resident R``): each scheme of ``--resident-schemes`` (default ``--schemes``) also runs as
``<scheme>+resident`` — ``EvictionConfig.resident_set(R, select=--select, summary=--summary, recall=--recall)``
gated ``certified(0.2)`` at head granularity (the granularity a resident read recalls at), under the same
``--device-budget`` as the gated variants (it caps what persistent recall keeps on the device).

Allocated variant (``--allocation FILE``, a ``kvcert allocate`` JSON, ``docs/codecs.md#bit-allocation``): the
allocation's per-(layer, KV head) dithered key widths and per-layer value codecs also run as ``allocated`` (raw,
unless ``--no-raw``) and ``allocated+gate``, under the same gate and device budget as the schemes.

Then the issue-16 target per gated or resident variant: capacity >= ``--target-capacity``, CI lower end >= −2
points with dense inside the CI, page-in <= 5 % of fp16, >= 60 samples over >= 5 tasks; and the issue-17 target
per resident variant: CI lower end >= −3 points with dense inside, recalled bytes per decode step <= 15 % of the
context's fp16 K/V, >= 45 samples over >= 5 tasks, 0 violations (all checked and printed; a run with fewer samples
prints which condition it misses).

Held-out discipline: samples are RULER's generated sets for ``--tasks`` at ``--seed`` (nothing is picked by
looking at results); the gate is the project's certified gate at the fixed τ = 0.2 (``--gate block``: the
block-granular persistent form ``kvcert eval --gate auto`` uses for informative schemes; ``head``: whole KV
heads); thresholds are never tuned to the measured seed.

Resumable: every finished sample is journaled (``DIR/samples.jsonl`` + its telemetry, :mod:`kvcert.eval.journal`)
before the next starts; rerunning the same command skips finished samples, a different config in the same
``--out`` is refused. Several workers may run the same command at once (each claims a sample before decoding it)
and may join or stop at any time. Samples are taken round-robin over the tasks, so an interrupted run stays
balanced.
``--report-only`` writes the report from the journal without decoding (e.g. while a run is in progress).
Outputs in ``--out``: results.json (every number with its tier), capacity.png (accuracy vs device bytes per
token; dense starred at fp16), summary.txt (the tables as markdown).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/capacity_ruler.py --schemes dither-int8/int4,dither-int8/int2 \\
        --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery \\
        --samples 10 --context 2048 --seed 16 --validate --out runs/capacity-2k
    # with a resident set (docs/results.md, "Certified capacity with a resident set")
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/capacity_ruler.py --schemes dither-int6/int2 --no-raw \\
        --device-budget 0.3333 --resident 0.25 --resident-schemes dither-int8/int2 --select snapkv \\
        --summary int8 --recall persistent --tasks ... --samples 8 --context 2048 --seed 16 --validate \\
        --out runs/capres-2k
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from rich.console import Console

from kvcert.attention.evict_driver import RESIDENT_ALLOCS
from kvcert.attention.resident import RECALLS, SUMMARIES
from kvcert.cache.gate import Gate
from kvcert.cache.telemetry import Telemetry
from kvcert.cli.common import (
    ALLOCATED,
    CERTIFIED_TAU,
    DEFAULT_SELECT,
    SELECT_POLICIES,
    LoadedModel,
    ResidentPlan,
    SchemeSpec,
    load_model,
    parse_gate,
    parse_heavy_values,
    parse_schemes,
    resident_fits,
    resident_gate,
    set_seed,
)
from kvcert.cli.frontier import frontier_results
from kvcert.cli.progress import progress_bar
from kvcert.cli.ruler_report import resident_table, summary_table, tier_b_table
from kvcert.cli.workload import DENSE, GATED_SUFFIX, RESIDENT_SUFFIX, VariantRecord, WorkloadResult
from kvcert.eval import ruler
from kvcert.eval.branching import Scheme, run_branches
from kvcert.eval.harness import prompt_ids
from kvcert.eval.journal import Journal, JournalRow, sample_key
from kvcert.models.zoo import ZOO, converted_dir
from kvcert.quant import Allocation
from kvcert.report.aggregate import fp16_bytes_per_token
from kvcert.report.results import EMPIRICAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, fmt, print_table, to_markdown

GATES = (
    "block",
    "block-transient",
    "head",
    "block-box",
    "block-transient-box",
    "box",
    "box-tier-b",
    "block-box-tier-b",
    "block-transient-box-tier-b",
)
TARGET_CI_LOW = -0.02  # issue 16: CI lower end >= -2 points
TARGET_PAGE_IN = 0.05  # page-in <= 5 % of the request's fp16 K/V bytes
TARGET_SAMPLES, TARGET_TASKS = 60, 5
RESIDENT_KIND = "resident"
RESIDENT_CI_LOW = -0.03  # issue 17: a resident set within the paired CI of dense, lower end >= -3 points
RESIDENT_RECALL_PER_STEP = 0.15  # recalled bytes per decode step <= 15 % of the context's fp16 K/V bytes
RESIDENT_SAMPLES = 45


@dataclass(frozen=True)
class ResidentOptions:
    """The resident variants of a run (``--resident``): each of ``specs`` with a resident set of ``fraction`` of
    its tokens chosen by ``select`` (a :data:`~kvcert.cli.common.SELECT_POLICIES` name), omitted pages summarised
    as ``summary``, recall ``persistent`` or ``transient``, split across layers by ``alloc`` (``uniform`` or
    ``mass``: ``EvictionConfig.resident_set(resident_alloc=)``), gated ``certified(τ = 0.2)`` at head granularity (the
    granularity a resident read recalls at)."""

    fraction: float
    select: str
    summary: str
    recall: str
    specs: tuple[SchemeSpec, ...]
    alloc: str = "uniform"

    def plan(self) -> ResidentPlan:
        """The CLI's description of these variants (the report code reads the policy and summary names from it)."""
        return ResidentPlan(
            self.fraction,
            self.select,
            resident_gate(None),
            self.specs,
            summary=self.summary,
            alloc=self.alloc,
            recall=self.recall,
        )

    def describe(self) -> dict[str, Any]:
        """The journal configuration of the resident variants."""
        return {
            "fraction": self.fraction,
            "select": self.select,
            "summary": self.summary,
            "recall": self.recall,
            "alloc": self.alloc,
            "schemes": [s.label for s in self.specs],
        }


def command() -> str:
    """This run's command line, as typed after the interpreter."""
    return " ".join(["benchmarks/capacity_ruler.py", *sys.argv[1:]])


def make_gate(name: str) -> Gate:
    """The certified gate at the project's fixed τ = 0.2 in the repair form ``name``, as the CLI's ``--gate
    certified:0.2[:UNIT]`` builds it: ``block`` (64-token blocks, written back exact), ``block-transient`` (the same
    blocks paged in for the read, nothing kept) or ``head`` (whole KV heads, transient); ``box`` alone (whole KV heads)
    or as the ``-box`` suffix of a block form certifies the heads the meter would repair again with the box
    supremum first (``certified:0.2[:UNIT]:box``); a further ``-tier-b`` serves heads on the partially certified box
    over the Tier-B radii too (``:box:tier-b``)."""
    if name not in GATES:
        raise ValueError(f"--gate must be one of {GATES}, got {name!r}")
    tier_b = name.endswith("-tier-b")
    base = name.removesuffix("-tier-b")
    unit = base.removesuffix("box").removesuffix("-")
    spec = (
        f"certified:{CERTIFIED_TAU}"
        + ("" if unit in ("", "head") else f":{unit}")
        + (":box" if base.endswith("box") else "")
        + (":tier-b" if tier_b else "")
    )
    gate = parse_gate(spec)
    assert gate is not None  # only "auto" parses to None
    return gate


def variants(
    specs: list[SchemeSpec],
    gate: Gate,
    raw: bool,
    validate: bool,
    budget: float | None,
    resident: ResidentOptions | None = None,
    gated: bool = True,
    allocation: Allocation | None = None,
) -> list[Scheme]:
    """Dense, then per scheme (and the allocation, as ``allocated``) raw (unless ``raw`` is False) and gated (unless
    ``gated`` is False), then the resident variants (``<scheme>+resident``); every kvcert variant validated if asked,
    every one under the same device budget."""
    out = [Scheme(DENSE)]
    rows = [(s.label, s.keys, s.values, None) for s in specs]
    if allocation is not None:
        rows.append((ALLOCATED, "dither-mixed", None, allocation))
    for label, keys, values, alloc in rows:
        if raw:
            out.append(Scheme(label, keys, values, Gate.off(), validate, device_budget=budget, allocation=alloc))
        if gated:
            out.append(
                Scheme(label + GATED_SUFFIX, keys, values, gate, validate, device_budget=budget, allocation=alloc)
            )
    if resident is not None:
        out += [
            Scheme(
                s.label + RESIDENT_SUFFIX,
                s.keys,
                s.values,
                resident_gate(None),
                validate,
                resident=resident.fraction,
                select=SELECT_POLICIES[resident.select],
                summary=resident.summary,
                recall=resident.recall,
                resident_alloc=resident.alloc,
                device_budget=budget,
            )
            for s in resident.specs
        ]
    return out


def round_robin(per_task: list[list[ruler.Sample]]) -> list[ruler.Sample]:
    """Sample 0 of every task, then sample 1 of every task, ...: any prefix of the run covers every task."""
    depth = max((len(t) for t in per_task), default=0)
    return [t[i] for i in range(depth) for t in per_task if i < len(t)]


def decode(
    loaded: LoadedModel, samples: list[ruler.Sample], schemes: list[Scheme], journal: Journal, args: argparse.Namespace
) -> None:
    """Decode every sample no worker has journaled or holds (:meth:`Journal.claim`) under every variant, and
    journal each as soon as it finishes."""
    console = Console()
    todo = len(samples) - len(journal.done())
    console.print(f"{len(samples) - todo} of {len(samples)} samples journaled; {todo} left for the workers")
    with progress_bar(f"decoded by this worker (× {len(schemes)} variants)", todo, console) as tick:
        for sample in samples:
            key = sample_key(sample.task, sample.index)
            if not journal.claim(key):
                continue
            budget = sample.max_new_tokens
            if args.max_new_tokens is not None:
                budget = min(budget, args.max_new_tokens)
            ids = prompt_ids(loaded.tokenizer, sample)
            results = run_branches(loaded.model, ids, schemes, budget, loaded.eos_ids, args.seed)
            texts = {r.scheme.name: loaded.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in results}
            row = JournalRow(sample.task, sample.index, {k: ruler.score(sample, t) for k, t in texts.items()}, texts)
            try:
                journal.append(row, {r.scheme.name: r.telemetry for r in results if r.telemetry is not None})
            except ValueError:  # journaled by another worker meanwhile (a claim taken over): keep theirs
                if key not in journal.done():
                    raise
            tick(0)


def workload_from(
    journal: Journal, samples: list[ruler.Sample], schemes: list[Scheme], resident: ResidentOptions | None
) -> WorkloadResult:
    """The journaled samples (in run order) as a :class:`WorkloadResult`, for ``kvcert eval``'s report code."""
    rows = {r.key: r for r in journal.rows()}
    kept = [s for s in samples if sample_key(s.task, s.index) in rows]
    plan = None if resident is None else resident.plan()
    recs = {
        sc.name: VariantRecord(
            sc.name,
            None if sc.is_dense else SchemeSpec(sc.keys or "", sc.values or ""),
            sc.gate,
            resident=None if sc.resident is None else plan,
        )
        for sc in schemes
    }
    for s in kept:
        row = rows[sample_key(s.task, s.index)]
        tels = journal.telemetry(row)
        for name, rec in recs.items():
            rec.scores.append(row.scores[name])
            rec.predictions.append(row.predictions[name])
            if name in tels:
                rec.telemetry.append(tels[name])
    return WorkloadResult(kept, list(recs.values()), {})


def request_fp16(tel: Telemetry) -> int:
    """The fp16 K/V bytes of every token the request wrote: resident and omitted tokens for a resident set
    (``bytes_fp16_context``; its ``bytes_fp16`` counts the resident tokens only), ``bytes_fp16`` otherwise."""
    return tel.bytes_fp16_context if tel.resident_fraction is not None else tel.bytes_fp16


def request_numbers(tels: list[Telemetry]) -> dict[str, Any]:
    """Bytes and traffic of one kvcert variant pooled over its samples, all against the fp16 K/V of every token the
    requests wrote (:func:`request_fp16`), so resident and non-resident variants share one denominator: device
    bytes per token and capacity, page-in over the requests, page-in per decode step (Σ page-in / Σ steps × fp16
    K/V: the mean step's share of the context it pages in) and, for a resident set, recalled bytes per decode
    step and (validate mode) the recall floor per decode step (``kvcert.attention.recall_floor``; over the requests it
    is the resident numbers' ``recall_floor_ratio``). Traffic is counted in the host tier's dtype. All measured
    (empirical)."""
    fp16 = [request_fp16(t) for t in tels]
    step_fp16 = sum(t.certificates.shape[0] * f for t, f in zip(tels, fp16, strict=True))
    total, device, paged = sum(fp16), sum(t.bytes_device for t in tels), sum(t.bytes_paged for t in tels)
    nan = float("nan")
    out = {
        "bytes_fp16_request": total,
        "bytes_per_token_device_request": fp16_bytes_per_token(tels[0]) * device / total if total else nan,
        "capacity_request": total / device if device else nan,
        "page_in_request": paged / total if total else nan,
        "decode_steps": sum(t.certificates.shape[0] for t in tels),
        "page_in_per_step": paged / step_fp16 if step_fp16 else nan,
    }
    if tels[0].resident_fraction is not None:
        out["recall_per_step"] = sum(t.bytes_recalled for t in tels) / step_fp16 if step_fp16 else nan
        floors = [t.bytes_recall_floor for t in tels if t.bytes_recall_floor is not None]
        if floors:  # validate mode: the recall no sound bound could have saved (over the request: recall_floor_ratio)
            out["recall_floor_per_step"] = sum(floors) / step_fp16 if step_fp16 else nan
    return {k: tiered(v, EMPIRICAL) for k, v in out.items()}


def add_request_numbers(results: dict[str, Any], result: WorkloadResult) -> None:
    """Add :func:`request_numbers` to every kvcert variant of ``results`` and mark resident variants
    ``kind = "resident"``; the dense row gets its fp16 bytes per token and capacity 1 under the same names."""
    variants = results["variants"]
    for rec in result.variants:
        v = variants[rec.label]
        if rec.telemetry:
            v.update(request_numbers(rec.telemetry))
        if rec.resident is not None:
            v["kind"] = RESIDENT_KIND
    dense = variants[DENSE]
    if "bytes_per_token_fp16" in dense:
        dense["bytes_per_token_device_request"] = dense["bytes_per_token_fp16"]
        dense["capacity_request"] = tiered(1.0, EMPIRICAL)


def _val(v: dict[str, Any], key: str) -> Any:
    return v[key]["value"] if key in v else None


def _ci(v: dict[str, Any]) -> str:
    low, high = _val(v, "ci95_low"), _val(v, "ci95_high")
    return "–" if low is None else f"[{100 * low:+.1f}, {100 * high:+.1f}]"


def _check(ok: bool, text: str) -> str:
    return f"{'✓' if ok else '✗'} {text}"


def capacity_table(results: dict[str, Any]) -> ReportTable:
    """One row per variant, sorted by device bytes per token, every byte figure against the request's fp16 K/V."""

    def dev(v: dict[str, Any]) -> float:
        return _val(v, "bytes_per_token_device_request") or float("inf")

    rows = []
    for label, v in sorted(results["variants"].items(), key=lambda kv: dev(kv[1])):
        viol, cells, rviol = _val(v, "violations"), _val(v, "cells"), _val(v, "recall_violations")
        rows.append(
            (
                label,
                v["gate"],
                fmt(_val(v, "accuracy"), percent=True),
                _ci(v),
                fmt(_val(v, "bytes_per_token_device_request"), 4),
                fmt(_val(v, "capacity_request"), 4),
                fmt(_val(v, "page_in_request"), 3),
                fmt(_val(v, "recall_floor_ratio"), 3),
                fmt(_val(v, "page_in_per_step"), 3),
                fmt(_val(v, "recall_per_step"), 3),
                fmt(_val(v, "coverage_kv@0.2"), percent=True),
                "–" if viol is None else f"{viol} / {cells}" + ("" if rviol is None else f" (+{rviol} recall)"),
            )
        )
    return ReportTable(
        "capacity and traffic per variant, against the fp16 K/V of every token each request wrote",
        (
            "variant",
            "gate",
            "acc",
            "Δ CI95 (pp)",
            "dev B/tok",
            "capacity",
            "page-in ×fp16",
            "floor ×fp16",
            "page-in/step ×fp16",
            "recall/step ×fp16",
            "cov@0.2",
            "violations / cells",
        ),
        tuple(rows),
        "dev B/tok = device-tier bytes at the end of the request (codes, scales, witnesses, exact entries, page "
        "summaries, held pages) per written token, all layers (dense: fp16 K/V); capacity = fp16 K/V of every "
        "written token (resident and omitted) / device bytes; page-in ×fp16 = host page-in over the request / that "
        "fp16 K/V; floor ×fp16 = the recall floor over the same fp16 K/V (validate mode, resident variants: read by "
        "read, the fewest omitted tokens' K/V any sound page-granular recall pages in); page-in/step and "
        "recall/step = the same per decode step (Σ bytes / Σ steps × fp16 K/V; recall: recalled pages only); "
        "traffic in the host tier's dtype. violations / cells = validate mode: cells whose "
        "exact TV exceeded the certificate (must be 0), (+ resident reads whose exact omitted mass exceeded its bound "
        "or whose post-recall TV exceeded the certificate). Tiers: acc, CI empirical; bytes, capacity, traffic "
        "measured (empirical); cov@0.2 certified.",
    )


def target_table(results: dict[str, Any], tasks: int, target_capacity: float) -> ReportTable:
    """Per gated or resident variant: the issue-16 conditions, each checked (✓ / ✗) with its number."""
    rows = []
    for label, v in results["variants"].items():
        if v.get("kind") not in ("gated", RESIDENT_KIND):
            continue
        low, high, n = _val(v, "ci95_low"), _val(v, "ci95_high"), _val(v, "samples")
        cap, page = _val(v, "capacity_request"), _val(v, "page_in_request")
        viol = _val(v, "violations")
        rows.append(
            (
                label,
                _check(cap is not None and cap >= target_capacity, fmt(cap, 4)),
                _check(low is not None and low >= TARGET_CI_LOW and low <= 0.0 <= high, _ci(v)),
                _check(page is not None and page <= TARGET_PAGE_IN, fmt(page, 4)),
                _check(n >= TARGET_SAMPLES and tasks >= TARGET_TASKS, f"{n} / {tasks} tasks"),
                "–" if viol is None else _check(viol == 0, str(viol)),
            )
        )
    return ReportTable(
        f"issue-16 targets per gated variant (capacity >= {target_capacity:g}×)",
        (
            "variant",
            "capacity",
            "Δ CI95 (pp) >= -2, ∋ 0",
            "page-in ×fp16 <= 0.05",
            "samples >= 60 / tasks >= 5",
            "violations",
        ),
        tuple(rows),
        "capacity, page-in: measured (empirical), against the fp16 K/V of every written token; Δ CI: paired "
        "bootstrap (empirical); violations: validate mode, cells whose exact TV exceeded the certified bound (must "
        "be 0). ✓/✗ = condition met / not met.",
    )


def resident_target_table(results: dict[str, Any], tasks: int) -> ReportTable | None:
    """Per resident variant: the issue-17 conditions (``None`` without resident variants)."""
    rows = []
    for label, v in results["variants"].items():
        if v.get("kind") != RESIDENT_KIND:
            continue
        low, high, n = _val(v, "ci95_low"), _val(v, "ci95_high"), _val(v, "samples")
        per_step, viol, rviol = _val(v, "recall_per_step"), _val(v, "violations"), _val(v, "recall_violations")
        rows.append(
            (
                label,
                v.get("select", "–"),
                fmt(_val(v, "resident_fraction"), percent=True),
                _check(low is not None and low >= RESIDENT_CI_LOW and low <= 0.0 <= high, _ci(v)),
                _check(per_step is not None and per_step <= RESIDENT_RECALL_PER_STEP, fmt(per_step, 3)),
                _check(n >= RESIDENT_SAMPLES and tasks >= TARGET_TASKS, f"{n} / {tasks} tasks"),
                "–" if viol is None else _check(viol == 0 and rviol == 0, f"{viol} + {rviol}"),
            )
        )
    if not rows:
        return None
    return ReportTable(
        "issue-17 targets per resident variant",
        (
            "variant",
            "select",
            "resident",
            "Δ CI95 (pp) >= -3, ∋ 0",
            "recall/step ×fp16 <= 0.15",
            "samples >= 45 / tasks >= 5",
            "violations + recall viol.",
        ),
        tuple(rows),
        "resident = share of written tokens held on the device (mean over samples); recall/step = recalled bytes "
        "(host dtype) per decode step / fp16 K/V of the context; violations: validate mode (must be 0). Tiers: all "
        "measured (empirical). ✓/✗ = condition met / not met.",
    )


def capacity_figure(results: dict[str, Any], path: Path) -> Path:
    """Two panels from the pooled numbers, one bar per variant labelled with its capacity: RULER accuracy with the
    paired 95% CI of the difference to dense drawn around dense's accuracy (left); page-in and recalled bytes per
    decode step over the context's fp16 K/V, and in validate mode the recall floor per step beside them (right)."""
    variants = results["variants"]
    names = list(variants)
    base = _val(variants[DENSE], "accuracy")
    ticks = [f"{n}\n{_val(variants[n], 'capacity_request'):.4g}×" for n in names]
    colours = {DENSE: "k", "raw": "tab:red", "gated": "tab:green", RESIDENT_KIND: "tab:purple"}
    xs = np.arange(len(names))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(xs, [_val(variants[n], "accuracy") for n in names], color=[colours[variants[n]["kind"]] for n in names])
    for x, n in zip(xs, names, strict=True):
        if "ci95_low" in variants[n]:
            low, high = _val(variants[n], "ci95_low"), _val(variants[n], "ci95_high")
            left.errorbar([x], [base], yerr=[[max(0.0, -low)], [max(0.0, high)]], color="grey", capsize=4)
    left.set_xticks(xs, ticks, fontsize=7)
    left.set_ylim(0, 1.05)
    left.set_ylabel("accuracy (empirical)")
    left.set_title("RULER accuracy; whiskers: dense + paired 95% CI of Δ; label: capacity", fontsize=8)
    kv = [n for n in names if n != DENSE]
    kx = np.arange(len(kv))
    bars = [("page_in_per_step", "tab:orange", "page-in per step (all)")]
    bars.append(("recall_per_step", "tab:purple", "recalled pages per step"))
    if any("recall_floor_per_step" in variants[n] for n in kv):  # validate mode with a resident variant
        bars.append(("recall_floor_per_step", "tab:grey", "recall floor per step (any sound bound)"))
    width = 0.8 / len(bars)
    right.axhline(RESIDENT_RECALL_PER_STEP, color="grey", linestyle=":", linewidth=1)
    for i, (key, colour, _) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        right.bar(kx + offset, [_val(variants[n], key) or 0.0 for n in kv], width=width, color=colour)
    right.legend(["issue-17 recall target (0.15)", *(label for *_, label in bars)], fontsize=7)
    right.set_xticks(kx, [t for n, t in zip(names, ticks, strict=True) if n != DENSE], fontsize=7)
    right.set_ylabel("× context fp16 K/V (measured)")
    right.set_title("host traffic per decode step (bytes in the host tier's dtype)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90, metadata={"Software": None})
    plt.close(fig)
    return path


def report(
    journal: Journal,
    samples: list[ruler.Sample],
    schemes: list[Scheme],
    resident: ResidentOptions | None,
    args: argparse.Namespace,
    t0: float,
) -> None:
    """Write results.json, capacity.png and summary.txt for the journaled samples; print the tables."""
    console = Console()
    result = workload_from(journal, samples, schemes, resident)
    if not result.samples:
        console.print("no sample journaled yet: nothing to report")
        return
    results = frontier_results(result, {}, {}, args.seed, args.resamples)
    add_request_numbers(results, result)
    tasks = len({s.task for s in result.samples})
    tables = [
        capacity_table(results),
        summary_table(results),
        *(
            t
            for t in (resident_table(results), resident_target_table(results, tasks), tier_b_table(results))
            if t is not None
        ),
        target_table(results, tasks, args.target_capacity),
    ]
    png = capacity_figure(results, args.out / "capacity.png")
    config = {**journal.config, "samples_journaled": len(result.samples), "samples_per_task": args.samples}
    doc = build_document("capacity_ruler", config, results, args.seed, {"seconds": time.time() - t0}, command().split())
    json_path = write_results(args.out / "results.json", doc)
    md = [f"`{command()}`", ""]
    md += [to_markdown(t) for t in tables]
    (args.out / "summary.txt").write_text("\n\n".join(md) + "\n", encoding="utf-8")
    for t in tables:
        print_table(console, t)
    console.print(f"{len(result.samples)} samples over {tasks} tasks; results: {json_path}; figure: {png}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name (smollm2-135m, gemma3-270m) or local folder")
    ap.add_argument("--schemes", required=True, help="comma-separated codec or keycodec/valuecodec")
    ap.add_argument("--tasks", required=True, help="comma-separated RULER tasks")
    ap.add_argument("--samples", type=int, required=True, help="samples per task")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--seed", type=int, required=True, help="RULER data seed (and codec dither seed, bootstrap seed)")
    ap.add_argument("--gate", choices=GATES, default="block", help="certified gate form at tau = 0.2")
    ap.add_argument(
        "--value-tol",
        type=float,
        default=None,
        help="the gate's value_tol: also serve a KV head's exact values (paged in for the read) when its output "
        "bound's value term exceeds this and its key term (docs/read-path.md#repair)",
    )
    ap.add_argument(
        "--value-rel",
        type=float,
        default=None,
        help="the gate's value_rel: serve every cell with its value term under this times the head's value spread, "
        "by value upgrades (or exact values) (docs/read-path.md#value-upgrades)",
    )
    ap.add_argument("--no-raw", dest="raw", action="store_false", help="skip the ungated variants")
    ap.add_argument(
        "--allocation", type=Path, default=None, help="also run this kvcert-allocate JSON as 'allocated' (module doc)"
    )
    ap.add_argument(
        "--no-gated",
        dest="gated",
        action="store_false",
        help="skip the gated variants of --schemes (with --resident: dense and the resident variants only)",
    )
    ap.add_argument("--validate", action="store_true", help="exact TV next to every certificate (violations)")
    ap.add_argument(
        "--device-budget",
        type=float,
        default=1.0,
        help="StorageConfig(device_budget=): the most of the fp16 K/V bytes persistent repair (and persistent "
        "recall) may fill (library default 1.0)",
    )
    ap.add_argument(
        "--exact-sinks",
        type=int,
        default=0,
        help="StorageConfig(exact_sinks=): keep the tokens at the first N positions exact in every kvcert variant "
        "(attention sinks; default 0)",
    )
    ap.add_argument(
        "--upgrade",
        default=None,
        metavar="KEYCODEC/VALUECODEC",
        help="StorageConfig(upgrade_keys=, upgrade_values=): persistent repairs re-encode the repaired entries in "
        "these codecs instead of holding them exact (docs/read-path.md#upgrade-repair)",
    )
    ap.add_argument(
        "--heavy-share",
        type=float,
        default=None,
        help="StorageConfig(heavy_share=): token tiers, this share of each KV head's prompt tokens (those its prefill "
        "attention singles out) stored in the --upgrade codecs instead of the light ones "
        "(docs/read-path.md#token-tiers)",
    )
    ap.add_argument(
        "--heavy-values",
        default=None,
        metavar="CODEC:SHARE",
        help="StorageConfig(heavy_values=, heavy_value_share=): token tiers' heavy values in CODEC, the top SHARE of "
        "the same ranking, instead of the --upgrade value codec on the --heavy-share (docs/read-path.md#heavy-values)",
    )
    ap.add_argument(
        "--bands",
        type=int,
        default=8,
        help="StorageConfig(bands=): key-witness bands of whole RoPE pairs per KV head (default 8; fewer store "
        "fewer witness bytes and loosen the Tier-A radius, docs/math.md#compact-witnesses)",
    )
    ap.add_argument(
        "--write-block",
        type=int,
        default=16,
        help="StorageConfig(write_block=): pending tokens stay exact until this many can be encoded together "
        "(default 16)",
    )
    ap.add_argument("--block-size", type=int, default=None, help="the block gates' block size (Gate default 64)")
    ap.add_argument(
        "--resident",
        type=float,
        default=None,
        help="also run a resident variant (<scheme>+resident, certified(0.2) at head granularity) keeping this "
        "fraction in (0, 1] of each KV head's tokens on the device",
    )
    ap.add_argument(
        "--resident-schemes",
        default=None,
        help="the schemes that get a resident variant (comma-separated like --schemes; default: --schemes)",
    )
    ap.add_argument("--select", choices=sorted(SELECT_POLICIES), default=None, help="resident-set policy")
    ap.add_argument("--summary", choices=SUMMARIES, default=None, help="page-summary storage (default int8)")
    ap.add_argument("--recall", choices=RECALLS, default=None, help="recall form (default persistent)")
    ap.add_argument(
        "--resident-alloc",
        choices=RESIDENT_ALLOCS,
        default=None,
        help="split of the resident tokens across layers: uniform (every layer keeps --resident) or mass (the same "
        "total, split by the select policy's prefill scores; default uniform)",
    )
    ap.add_argument("--target-capacity", type=float, default=3.0)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap on RULER's generation budget")
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--out", type=Path, required=True, help="journal and report directory (resumable)")
    ap.add_argument("--report-only", action="store_true", help="report the journaled samples, decode nothing")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.resamples < 1:
        ap.error("--samples and --resamples must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if not (args.device_budget > 0 and math.isfinite(args.device_budget)):
        ap.error("--device-budget must be a finite fraction > 0")
    if args.exact_sinks < 0:
        ap.error(f"--exact-sinks must be >= 0, got {args.exact_sinks}")
    if args.upgrade is not None and len(args.upgrade.split("/")) != 2:
        ap.error(f"--upgrade takes KEYCODEC/VALUECODEC, got {args.upgrade!r}")
    if args.write_block < 1 or args.bands < 1:
        ap.error(f"--write-block and --bands must be >= 1, got {args.write_block} and {args.bands}")
    if args.block_size is not None and args.block_size < 1:
        ap.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.heavy_share is not None and (args.upgrade is None or not 0.0 < args.heavy_share < 1.0):
        ap.error(f"--heavy-share takes a fraction in (0, 1) and needs --upgrade, got {args.heavy_share}")
    if args.heavy_values is not None and args.heavy_share is None:
        ap.error("--heavy-values is a setting of token tiers: give --heavy-share too")
    if args.resident is None:
        given = [
            f"--{k.replace('_', '-')}"
            for k in ("resident_schemes", "select", "summary", "recall", "resident_alloc")
            if vars(args)[k]
        ]
        if given:
            ap.error(f"{', '.join(given)} describe the resident variants: pass --resident <fraction in (0, 1]>")
        if not args.gated and not args.raw:
            ap.error("--no-raw --no-gated without --resident leaves no variant to compare with dense")
    elif not 0.0 < args.resident <= 1.0:
        ap.error(f"--resident must be a fraction in (0, 1], got {args.resident}")
    elif args.resident_alloc == "mass" and not SELECT_POLICIES[args.select or DEFAULT_SELECT]().needs_attention:
        ap.error(f"--resident-alloc mass splits by attention scores; --select {args.select} has none")
    return args


def resident_options(args: argparse.Namespace) -> ResidentOptions | None:
    """The resident variants asked for (``None`` without ``--resident``); library defaults where not given."""
    if args.resident is None:
        return None
    specs = parse_schemes(args.resident_schemes or args.schemes)
    return ResidentOptions(
        args.resident,
        args.select or DEFAULT_SELECT,
        args.summary or "int8",
        args.recall or "persistent",
        tuple(specs),
        args.resident_alloc or "uniform",
    )


def main() -> None:
    args = parse_args()
    t0 = time.time()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:
        ruler.task_config(t)
    specs = parse_schemes(args.schemes)
    resident = resident_options(args)
    if resident is not None:
        resident_fits(resident.plan(), args.context)
    allocation = None if args.allocation is None else Allocation.load(args.allocation)
    gate = make_gate(args.gate)
    gate = gate if args.value_tol is None else dataclasses.replace(gate, value_tol=args.value_tol)
    gate = gate if args.value_rel is None else dataclasses.replace(gate, value_rel=args.value_rel)
    gate = gate if args.block_size is None else dataclasses.replace(gate, block_size=args.block_size)
    schemes = variants(specs, gate, args.raw, args.validate, args.device_budget, resident, args.gated, allocation)
    upgrade = None if args.upgrade is None else tuple(args.upgrade.split("/"))
    heavy_values = parse_heavy_values(args.heavy_values)
    schemes = [
        s
        if s.is_dense
        else dataclasses.replace(
            s,
            exact_sinks=args.exact_sinks,
            upgrade=upgrade,
            heavy_share=args.heavy_share,
            heavy_values=heavy_values,
            bands=args.bands,
            write_block=args.write_block,
        )
        for s in schemes
    ]
    config = {
        "model": args.model,
        "tasks": tasks,
        "context": args.context,
        "seed": args.seed,
        "variants": {s.name: s.gate.describe() for s in schemes},
        "validate": args.validate,
        "device_budget": args.device_budget,
        "exact_sinks": args.exact_sinks,
        **({} if upgrade is None else {"upgrade": list(upgrade)}),
        **({} if args.block_size is None else {"block_size": args.block_size}),
        **({} if args.heavy_share is None else {"heavy_share": args.heavy_share}),
        **({} if heavy_values is None else {"heavy_values": list(heavy_values)}),
        **({} if args.bands == 8 else {"bands": args.bands}),
        **({} if args.write_block == 16 else {"write_block": args.write_block}),
        "max_new_tokens": args.max_new_tokens,
        **({} if resident is None else {"resident": resident.describe()}),
        **(
            {} if allocation is None else {"allocation": {"key_bits": allocation.key_bits, "values": allocation.values}}
        ),
    }
    journal = Journal(args.out, config)
    set_seed(args.seed)
    loaded = None if args.report_only else load_model(args.model, args.seed)
    tok_dir = converted_dir(args.model) if loaded is None and args.model in ZOO else Path(args.model)
    tok_dir = tok_dir if loaded is None else loaded.tokenizer_dir
    samples = round_robin([ruler.load_task(t, args.context, args.samples, args.seed, tok_dir) for t in tasks])
    if loaded is not None:
        decode(loaded, samples, schemes, journal, args)
    report(journal, samples, schemes, resident, args, t0)


if __name__ == "__main__":
    main()
