"""``kvcert run``: the main job — SmolLM2 on a small RULER needle set, schemes raw and gated, one report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvcert.cache.gate import Gate
from kvcert.cli.common import (
    CERTIFIED_TAU,
    DEFAULT_SCHEMES,
    DEFAULT_SELECT,
    RUN_RESIDENT_CODEC,
    RUN_RESIDENT_FRACTION,
    ModelOption,
    ResidentPlan,
    SchemesOption,
    SchemeSpec,
    TasksOption,
    default_out,
    parse_schemes,
    task_names,
)
from kvcert.cli.ruler_command import RulerJob, execute
from kvcert.cli.validate import OverwriteOption, checked_inputs

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_multikey_1"


def run(
    model: ModelOption = "smollm2-135m",
    context: Annotated[int, typer.Option(help="RULER sequence length in tokens")] = 2048,
    tasks: TasksOption = DEFAULT_TASKS,
    samples: Annotated[int, typer.Option(help="samples per task")] = 2,
    schemes: SchemesOption = DEFAULT_SCHEMES,
    seed: Annotated[int, typer.Option(help="seed for data, codecs and bootstrap")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="cap on RULER's per-task generation budget")] = 16,
    out: Annotated[Path | None, typer.Option(help="report directory (default runs/run-<timestamp>)")] = None,
    overwrite: OverwriteOption = False,
) -> None:
    """The main job: RULER needle tasks under each scheme, ungated and gated, against the dense baseline.

    Each scheme's gate is chosen from its own meter on the first sample: certified(τ=0.2) when at least
    half of its cells are informative, else risk-ranked(τ_gate=5). One resident variant runs beside them:
    int8 storage with a resident set of 25% of the tokens (SnapKV), gated certified(τ=0.2) with recall.
    Writes report.html, PNGs and results.json to --out and prints a summary table.
    """
    with checked_inputs("run"):
        specs = parse_schemes(schemes)
    task_list = task_names(tasks)
    job = RulerJob(
        "run",
        model,
        task_list,
        context,
        samples,
        tuple(specs),
        None,
        seed,
        max_new_tokens,
        10_000,
        out or default_out("run"),
        overwrite,
        ResidentPlan(
            RUN_RESIDENT_FRACTION,
            DEFAULT_SELECT,
            Gate.certified(CERTIFIED_TAU),
            (SchemeSpec(RUN_RESIDENT_CODEC, RUN_RESIDENT_CODEC),),
        ),
    )
    execute(job, Console())
