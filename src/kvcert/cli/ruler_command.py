"""The shared body of ``kvcert run`` and ``kvcert eval``: load, generate RULER samples, decode, report."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console

from kvcert.cache.gate import Gate
from kvcert.cli.common import (
    ResidentPlan,
    SchemeSpec,
    command_line,
    load_model,
    resident_fits,
    schemes_fit,
    set_seed,
)
from kvcert.cli.progress import progress_bar
from kvcert.cli.ruler_report import write_report
from kvcert.cli.validate import (
    at_least,
    checked_inputs,
    context_fits,
    loaded_context_fits,
    model_max_positions,
    prepare_out,
    ruler_tasks,
    seed_in_range,
)
from kvcert.cli.workload import WorkloadResult, run_workload
from kvcert.eval import ruler
from kvcert.report.tables import print_table


@dataclass(frozen=True)
class RulerJob:
    """Inputs of one RULER evaluation (the ``config`` section of results.json)."""

    name: str
    model: str
    tasks: tuple[str, ...]
    context: int
    samples: int
    schemes: tuple[SchemeSpec, ...]
    gate: Gate | None
    seed: int
    max_new_tokens: int | None
    resamples: int
    out: Path
    overwrite: bool = False
    resident: ResidentPlan | None = None
    validate: bool = False

    def config(self) -> dict[str, object]:
        """JSON-ready inputs."""
        return {
            "model": self.model,
            "tasks": list(self.tasks),
            "context": self.context,
            "samples": self.samples,
            "schemes": [s.label for s in self.schemes],
            "witness": self.schemes[0].witness,
            "device_budget": self.schemes[0].device_budget,
            "exact_sinks": self.schemes[0].exact_sinks,
            "upgrade": None if self.schemes[0].upgrade is None else "/".join(self.schemes[0].upgrade),
            "heavy_share": self.schemes[0].heavy_share,
            "heavy_values": None
            if self.schemes[0].heavy_values is None
            else ":".join(map(str, self.schemes[0].heavy_values)),
            "bands": self.schemes[0].bands,
            "gate": "auto" if self.gate is None else self.gate.describe(),
            "seed": self.seed,
            "max_new_tokens": self.max_new_tokens,
            "bootstrap_resamples": self.resamples,
            "out": str(self.out),
            "resident": None if self.resident is None else self.resident.fraction,
            "select": None if self.resident is None else self.resident.select,
            "reselect": None if self.resident is None else self.resident.reselect,
            "summary": None if self.resident is None else self.resident.summary,
            "resident_alloc": None if self.resident is None else self.resident.alloc,
            "recall": None if self.resident is None else self.resident.recall,
            "resident_gate": None if self.resident is None else self.resident.gate.describe(),
            "resident_schemes": [] if self.resident is None else [s.label for s in self.resident.specs],
            "validate": self.validate,
        }


def check_ruler_inputs(
    model: str,
    tasks: Sequence[str],
    context: int,
    resident: ResidentPlan | None,
    samples: int,
    resamples: int,
    seed: int,
    max_new_tokens: int | None,
    out: Path,
    overwrite: bool,
) -> int | None:
    """The checks every RULER command (``run``, ``eval``, ``frontier``) makes before loading, inside the caller's
    :func:`~kvcert.cli.validate.checked_inputs`: tasks and context against the model's positions, the resident plan,
    counts, seed and ``--out``. Returns the model's ``max_position_embeddings`` (``None``: known only once a zoo
    model is converted, so the caller checks the context again after loading)."""
    positions = model_max_positions(model)
    ruler_tasks(tasks, context)
    context_fits(context, positions)
    resident_fits(resident, context)
    at_least("samples", samples, 1)
    at_least("resamples", resamples, 1)
    seed_in_range(seed)
    if max_new_tokens is not None:
        at_least("max-new-tokens", max_new_tokens, 1)
    prepare_out(out, overwrite)
    return positions


def execute(job: RulerJob, console: Console) -> Path:
    """Run ``job`` end to end; print the summary table and where the report is; return report.html."""
    t0 = time.time()
    with checked_inputs(job.name):
        positions = check_ruler_inputs(
            job.model,
            job.tasks,
            job.context,
            job.resident,
            job.samples,
            job.resamples,
            job.seed,
            job.max_new_tokens,
            job.out,
            job.overwrite,
        )
    set_seed(job.seed)
    console.print(f"loading model [bold]{job.model}[/] ...")
    loaded = load_model(job.model, job.seed)
    with checked_inputs(job.name):
        loaded_context_fits(job.context, positions, loaded.model)
        schemes_fit(job.schemes, loaded.model)
    t_load = time.time()
    samples = []
    with progress_bar("generating RULER samples", len(job.tasks), console) as tick:
        for i, task in enumerate(job.tasks):
            samples += ruler.load_task(task, job.context, job.samples, job.seed, loaded.tokenizer_dir)
            tick(i)
    t_data = time.time()
    n_variants = 1 + 2 * len(job.schemes) + (0 if job.resident is None else len(job.resident.specs))
    with progress_bar(f"decoding {len(samples)} samples × {n_variants} variants", len(samples), console) as tick:
        result = run_workload(
            loaded,
            samples,
            job.schemes,
            job.gate,
            job.seed,
            job.max_new_tokens,
            validate=job.validate,
            on_sample=tick,
            resident=job.resident,
        )
    t_run = time.time()
    volatile = {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "seconds": {"load": t_load - t0, "data": t_data - t_load, "decode": t_run - t_data},
    }
    json_path, html_path, tables = write_report(
        result,
        job.out,
        job.name,
        command_line(),
        job.config(),
        job.seed,
        job.resamples,
        volatile,
        f"kvcert {job.name}: {job.model}",
    )
    for table in tables:
        print_table(console, table)
    console.print(f"wall time {time.time() - t0:.0f} s; results: {json_path}")
    console.print(f"report: [bold]{html_path}[/]")
    exit_on_violations(result, console)
    return html_path


def exit_on_violations(result: WorkloadResult, console: Console) -> None:
    """Exit with status 1, saying how many, when a validated run found cells whose exact TV exceeded the certificate
    (``eval``, ``frontier``; after the report is written)."""
    if result.violations:
        console.print(f"[bold red]SOUNDNESS VIOLATION: {result.violations} cell(s) with true TV > certificate[/]")
        raise typer.Exit(1)
