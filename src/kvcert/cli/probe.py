"""``kvcert probe ...``: probe snapshot tools (the lead mounts ``app`` as the ``probe`` sub-app)."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Annotated

import typer

from kvcert.probe.verify import VerifyResult, verify_file

app = typer.Typer(help="Probe snapshot tools.", no_args_is_help=True)

EXIT_OK, EXIT_FAIL, EXIT_NO_FILES = 0, 1, 2


@app.callback()
def probe() -> None:
    """Probe snapshot tools."""


def _expand(patterns: list[str]) -> list[tuple[str, Path | None]]:
    """Each argument as an existing path, else its glob matches (sorted), else ``(arg, None)``."""
    out: list[tuple[str, Path | None]] = []
    for pattern in patterns:
        matches = [pattern] if Path(pattern).exists() else sorted(glob.glob(pattern))
        if not matches:
            out.append((pattern, None))
        out.extend((m, Path(m)) for m in matches)
    return out


@app.command()
def verify(
    files: Annotated[list[str] | None, typer.Argument(help="snapshot files or glob patterns")] = None,
) -> None:
    """Gate each snapshot: coverage, magnitude, soundness. Exit 0 all pass, 1 any failure, 2 no files."""
    if not files:
        typer.echo("no snapshot files given", err=True)
        raise typer.Exit(EXIT_NO_FILES)
    targets = _expand(files)
    failed = 0
    for name, path in targets:
        if path is None:
            result = VerifyResult(ok=False, stage="schema", reasons=(f"schema: no such file {name!r}",))
        else:
            result = verify_file(path)
        if result.ok:
            typer.echo(f"PASS {name}")
            continue
        failed += 1
        typer.echo(f"FAIL {name} [{result.stage}] -- this run's numbers are void")
        for reason in result.reasons:
            typer.echo(f"  {reason}")
    typer.echo(f"{failed} of {len(targets)} snapshot(s) failed" if failed else f"all {len(targets)} passed")
    raise typer.Exit(EXIT_FAIL if failed else EXIT_OK)
