"""``kvcert eval``: RULER accuracy per scheme with paired bootstrap CI and McNemar p against dense."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

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
    UpgradeOption,
    ValidateOption,
    WitnessOption,
    default_out,
    ruler_variants,
    task_names,
)
from kvcert.cli.ruler_command import RulerJob, execute
from kvcert.cli.validate import OverwriteOption, checked_inputs, ruler_tasks

TASK_PREFIX = "ruler:"
DEFAULT_TASK = "niah_single_1"


def parse_task_option(text: str) -> tuple[str, ...]:
    """``ruler:t1,t2`` -> ``("t1", "t2")`` (``--task``, the older spelling of ``--tasks t1,t2``); raises
    ``ValueError`` naming ``--task`` otherwise."""
    if not text.startswith(TASK_PREFIX):
        raise ValueError(f"--task: expected ruler:<task1,task2,...>, got {text!r} (or give --tasks <task1,task2,...>)")
    tasks = task_names(text[len(TASK_PREFIX) :])
    if not tasks:
        raise ValueError("--task: no RULER task after 'ruler:'")
    return tasks


def eval_tasks(tasks: str | None, task: str | None) -> tuple[tuple[str, ...], str]:
    """The tasks ``eval`` runs and the option that named them: ``--tasks t1,t2`` (as ``run`` and ``frontier`` take
    them) or ``--task ruler:t1,t2``, not both (``ValueError``); neither: :data:`DEFAULT_TASK`."""
    if tasks is not None and task is not None:
        raise ValueError("give one of --tasks and --task (--task ruler:T1,T2 is the older spelling of --tasks T1,T2)")
    if task is not None:
        return parse_task_option(task), "--task"
    return task_names(DEFAULT_TASK if tasks is None else tasks), "--tasks"


def evaluate(
    tasks: Annotated[
        str | None, typer.Option(help=f"comma-separated RULER tasks (default {DEFAULT_TASK})", show_default=False)
    ] = None,
    task: Annotated[str | None, typer.Option(help="ruler:<task1,task2,...>, the older spelling of --tasks")] = None,
    context: ContextOption = 2048,
    samples: SamplesOption = 2,
    schemes: SchemesOption = DEFAULT_SCHEMES,
    gate: GateOption = "auto",
    model: ModelOption = "smollm2-135m",
    seed: SeedOption = 0,
    max_new_tokens: MaxNewTokensOption = None,
    resamples: ResamplesOption = 10_000,
    out: Annotated[Path | None, typer.Option(help="report directory (default runs/eval-<timestamp>)")] = None,
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
    """Accuracy per scheme (raw and gated, and resident with --resident) with a paired bootstrap 95% CI and exact
    McNemar p against the uncompressed run on the same samples, plus bytes per token, host page-in bytes and
    fallback rate (and resident fraction, omitted-mass bound and recall for resident variants)."""
    with checked_inputs("eval"):
        task_list, option = eval_tasks(tasks, task)
        ruler_tasks(task_list, context, option)
        settings = ResidentSettings(resident, select, reselect, summary, resident_alloc, recall)
        storage = StorageOptions(witness, device_budget, exact_sinks, upgrade, heavy_share, bands, heavy_values)
        variants = ruler_variants(schemes, storage, allocation, gate, settings)
    job = RulerJob(
        "eval",
        model,
        task_list,
        context,
        samples,
        variants.specs,
        variants.gate,
        seed,
        max_new_tokens,
        resamples,
        out or default_out("eval"),
        overwrite,
        variants.plan,
        validate,
    )
    execute(job, Console())
