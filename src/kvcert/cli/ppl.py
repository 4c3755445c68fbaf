"""``kvcert ppl``: teacher-forced perplexity with the continuation read through each scheme's cache.

Per window of ``context`` tokens (consecutive, non-overlapping, from the corpus start), the harness's
:func:`kvcert.eval.harness.perplexity` prefills the first ``prefix`` tokens into a fresh cache (compressed
for kvcert schemes) and feeds the rest in chunks through it, so every scored logit is computed by
attention over the compressed cache. Each scheme runs raw, then gated; with ``--gate auto`` the gate is
chosen from the raw run's informative fraction on the first window, as in ``kvcert run``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from transformers import Cache, PreTrainedModel

from kvcert.cache.gate import Gate
from kvcert.cache.telemetry import Telemetry
from kvcert.cli.common import (
    DEFAULT_SCHEMES,
    GateOption,
    LoadedModel,
    ModelOption,
    SchemesOption,
    SchemeSpec,
    auto_gate,
    check_tier_b_gate,
    command_line,
    default_out,
    load_model,
    parse_gate,
    parse_schemes,
    set_seed,
)
from kvcert.cli.progress import progress_bar
from kvcert.cli.validate import (
    OverwriteOption,
    at_least,
    checked_inputs,
    context_fits,
    loaded_context_fits,
    model_max_positions,
    prepare_out,
    seed_in_range,
)
from kvcert.eval.corpora import CORPORA, load_corpus
from kvcert.eval.harness import decode_text, perplexity
from kvcert.integrations.transformers import CertifiedCache
from kvcert.report import aggregate, figures
from kvcert.report.html import write_html
from kvcert.report.results import CERTIFIED, EMPIRICAL, build_document, tiered, write_results
from kvcert.report.tables import ReportTable, fmt, print_table

CHARS_PER_TOKEN = 8  # characters read per needed token before tokenizing (generous)
WINDOW_SLACK = 16  # extra tokens decoded into each window's text so re-tokenizing still yields ``context``


@dataclass
class PplRecord:
    """Summed negative log-likelihood and token count of one variant, and its per-window telemetry."""

    label: str
    gate: Gate
    nll: float = 0.0
    tokens: int = 0
    telemetry: list[Telemetry] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        """``exp(mean NLL)`` over all scored tokens of all windows."""
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def add(
        self,
        loaded: LoadedModel,
        text: str,
        context: int,
        prefix: int,
        chunk: int,
        factory: Callable[[PreTrainedModel], Cache | None],
    ) -> None:
        """Score one window with ``factory``'s cache and accumulate its NLL."""
        res = perplexity(loaded.model, loaded.tokenizer, text, context, factory, stride=chunk, prefix=prefix)
        self.nll += res.mean_nll * res.tokens_scored
        self.tokens += res.tokens_scored


def run_ppl(
    loaded: LoadedModel,
    texts: list[str],
    specs: list[SchemeSpec],
    gate: Gate | None,
    context: int,
    prefix: int,
    chunk: int,
    seed: int,
    tick: Callable[[int], None],
) -> tuple[list[PplRecord], dict[str, str]]:
    """Perplexity of dense and of each scheme raw and gated over the window ``texts``."""
    records: dict[str, PplRecord] = {"dense": PplRecord("dense", Gate.off())}
    chosen: dict[str, Gate] = {}
    for text in texts:
        records["dense"].add(loaded, text, context, prefix, chunk, lambda _m: None)
        for spec in specs:
            variants: list[tuple[str, Gate | None]] = [(spec.label, Gate.off())]
            if gate is None or gate.mode != "off":
                variants.append((spec.label + "+gate", gate))
            for label, g in variants:
                if g is None:
                    g = chosen.setdefault(spec.label, auto_gate(records[spec.label].telemetry[0].informative_fraction))
                elif label != spec.label:
                    chosen[spec.label] = g
                rec = records.setdefault(label, PplRecord(label, g))
                caches: list[CertifiedCache] = []

                def factory(
                    m: PreTrainedModel,
                    g: Gate = g,
                    spec: SchemeSpec = spec,
                    caches: list[CertifiedCache] = caches,
                ) -> Cache:
                    caches.append(CertifiedCache(m, keys=spec.keys, values=spec.values, gate=g, seed=seed))
                    return caches[-1]

                try:
                    rec.add(loaded, text, context, prefix, chunk, factory)
                finally:
                    for c in caches:
                        c.detach()
                rec.telemetry += [c.telemetry() for c in caches]
        tick(0)
    return list(records.values()), {k: g.describe() for k, g in chosen.items()}


def _value(results: dict[str, Any], label: str, key: str) -> Any:
    return results["variants"][label].get(key, {}).get("value")


def ppl_numbers(rec: PplRecord, dense: PplRecord) -> dict[str, Any]:
    """Tiered numbers of one variant (perplexity empirical; meter certified; bytes measured)."""
    out: dict[str, Any] = {
        "gate": rec.gate.describe(),
        "perplexity": tiered(rec.perplexity, EMPIRICAL),
        "delta_ppl_vs_dense": tiered(rec.perplexity - dense.perplexity, EMPIRICAL),
        "scored_tokens": tiered(rec.tokens, EMPIRICAL),
    }
    tels = rec.telemetry
    if tels:
        out.update({k: tiered(v, EMPIRICAL) for k, v in aggregate.byte_numbers(tels).items()})  # measured
        out.update(
            {
                "fallback_rate": tiered(aggregate.pooled(tels, lambda t: t.fallback_rate), EMPIRICAL),
                "coverage_kv@0.2": tiered(aggregate.pooled(tels, lambda t: t.coverage(0.2, "kv_head")), CERTIFIED),
                "informative_fraction": tiered(aggregate.pooled(tels, lambda t: t.informative_fraction), CERTIFIED),
            }
        )
    return out


def ppl(
    corpus: Annotated[str, typer.Option(help=" | ".join(CORPORA))] = "pg-essays",
    context: Annotated[int, typer.Option(help="tokens per window (prefix + scored continuation)")] = 1024,
    windows: Annotated[int, typer.Option(help="number of consecutive windows")] = 2,
    prefix_fraction: Annotated[float, typer.Option(help="share of each window prefilled exactly")] = 0.5,
    chunk: Annotated[int, typer.Option(help="continuation tokens per forward through the cache")] = 64,
    schemes: SchemesOption = DEFAULT_SCHEMES,
    gate: GateOption = "auto",
    model: ModelOption = "smollm2-135m",
    seed: Annotated[int, typer.Option(help="seed for codecs")] = 0,
    out: Annotated[Path | None, typer.Option(help="report directory (default runs/ppl-<timestamp>)")] = None,
    overwrite: OverwriteOption = False,
) -> None:
    """Teacher-forced perplexity under each scheme, ungated and gated, with the continuation read through
    the compressed cache; bytes per token, page-in and meter coverage beside it."""
    out = out or default_out("ppl")
    with checked_inputs("ppl"):
        specs = parse_schemes(schemes)
        chosen = parse_gate(gate)
        check_tier_b_gate(gate, chosen, specs)
        seed_in_range(seed)
        if corpus not in CORPORA:
            raise ValueError(f"--corpus: expected one of {sorted(CORPORA)}, got {corpus!r}")
        if not 0.0 < prefix_fraction < 1.0:
            raise ValueError(f"--prefix-fraction must be in (0, 1), got {prefix_fraction}")
        at_least("context", context, 3)
        at_least("windows", windows, 1)
        at_least("chunk", chunk, 1)
        prefix = int(context * prefix_fraction)
        if prefix < 1 or context - prefix < 2:
            raise ValueError(
                f"need context*prefix_fraction >= 1 and >= 2 scored tokens "
                f"(got context={context}, prefix-fraction={prefix_fraction})"
            )
        positions = model_max_positions(model)
        context_fits(context, positions)
        prepare_out(out, overwrite)
    console, t0 = Console(), time.time()
    set_seed(seed)
    loaded = load_model(model, seed)
    with checked_inputs("ppl"):
        loaded_context_fits(context, positions, loaded.model)
        try:
            text = load_corpus(corpus)
        except ImportError as exc:
            raise ValueError(str(exc)) from exc
        need = (context + WINDOW_SLACK) * windows
        ids = loaded.tokenizer(text[: need * CHARS_PER_TOKEN], return_tensors="pt").input_ids[0]
        if ids.numel() < need:
            raise ValueError(f"corpus {corpus} has {ids.numel()} tokens, need {need} for --windows/--context")
    texts = [
        decode_text(loaded.tokenizer, ids[i * context : (i + 1) * context + WINDOW_SLACK], skip_special=False)
        for i in range(windows)
    ]
    with progress_bar(f"perplexity over {windows} window(s)", windows, console) as tick:
        records, gates = run_ppl(loaded, texts, specs, chosen, context, prefix, chunk, seed, tick)
    dense = records[0]
    results: dict[str, Any] = {"variants": {r.label: ppl_numbers(r, dense) for r in records}, "gate_choice": gates}
    measured = [r for r in records if r.telemetry]
    if measured:  # the dense row shows what an fp16 cache holds, to compare with
        fp16_tok = aggregate.fp16_bytes_per_token(measured[0].telemetry[0])
        results["variants"][dense.label].setdefault("bytes_per_token_fp16", tiered(fp16_tok, EMPIRICAL))
    config = {
        "model": model,
        "corpus": corpus,
        "context": context,
        "windows": windows,
        "prefix": prefix,
        "chunk": chunk,
        "schemes": [s.label for s in specs],
        "gate": gate,
        "seed": seed,
        "out": str(out),
    }
    out.mkdir(parents=True, exist_ok=True)
    doc = build_document("ppl", config, results, seed, {"seconds": time.time() - t0}, command_line().split())
    json_path = write_results(out / "results.json", doc)
    table = ReportTable(
        f"perplexity on {corpus} ({windows} × {context} tokens, exact prefix {prefix})",
        ("scheme", "gate", "perplexity", "Δ vs dense", "dev B/tok", "capacity", "page-in ×fp16", "KV-head cov@0.2"),
        tuple(
            (
                r.label,
                r.gate.describe(),
                fmt(r.perplexity, 5),
                fmt(r.perplexity - dense.perplexity, 3),
                fmt(
                    _value(results, r.label, "bytes_per_token_device")
                    or _value(results, r.label, "bytes_per_token_fp16"),
                    4,
                ),
                fmt(_value(results, r.label, "capacity"), 2),
                fmt(_value(results, r.label, "page_in_ratio"), 3),
                fmt(results["variants"][r.label].get("coverage_kv@0.2", {}).get("value"), percent=True),
            )
            for r in records
        ),
        "dev B/tok = device-tier bytes per token at the end (dense: fp16 K/V); capacity = fp16 / device bytes; "
        "page-in ×fp16 = page-in traffic / fp16 K/V bytes. perplexity and Δ vs dense: empirical; coverage: certified; "
        "bytes, capacity, page-in: measured (empirical)",
    )
    compressed = [r for r in records if r.telemetry and r.gate.mode == "off"]
    figs = (
        [
            figures.coverage_curve(
                {r.label: aggregate.cells(r.telemetry, "certificates") for r in compressed},
                out / "coverage_vs_tau.png",
                "coverage vs τ per scheme, ungated",
            )
        ]
        if compressed
        else []
    )
    html_path = write_html(
        out / "report.html",
        f"kvcert ppl: {model} on {corpus}",
        [f"Gates: {gates or 'none'}."],
        [table],
        figs,
        command_line(),
    )
    print_table(console, table)
    console.print(f"results: {json_path}\nreport: [bold]{html_path}[/]")
