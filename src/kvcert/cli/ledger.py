"""``kvcert ledger``: gate a run on the zero-criteria, replay an event log, print sentinel latencies."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcert.ledger.gate import evaluate
from kvcert.ledger.replay import diff_states
from kvcert.ledger.replay import replay as replay_log
from kvcert.ledger.sentinel import latency_table, rounds_needed

app = typer.Typer(help="Request-level risk ledger: gate, replay, sentinel.", no_args_is_help=True)

_SQLITE_MAGIC = b"SQLite format 3\x00"


def _load_run(run: Path) -> list[dict[str, Any]]:
    """The snapshots of a run: one (see :func:`_load`), or one per rank of a replica run directory that holds
    ``rank{r}/`` subdirectories (:mod:`kvcert.serving.replicas`)."""
    if run.is_dir() and not any((run / name).is_file() for name in ("ledger.json", "ledger.db")):
        ranks = sorted((p for p in run.iterdir() if p.is_dir() and re.fullmatch(r"rank\d+", p.name)), key=str)
        if ranks:
            return [_load(p) for p in ranks]
    return [_load(run)]


def _load(run: Path) -> dict[str, Any]:
    """A snapshot from a JSON file, a run directory holding ``ledger.json`` / ``ledger.db``, or a log."""
    if run.is_dir():
        for name in ("ledger.json", "ledger.db"):
            if (run / name).is_file():
                return _load(run / name)
        raise ValueError(f"run directory {str(run)!r} holds neither ledger.json, ledger.db nor rank*/ directories")
    if not run.is_file():
        raise ValueError(f"run {str(run)!r} does not exist")
    with run.open("rb") as fh:
        head = fh.read(16)
    if head == _SQLITE_MAGIC:
        return replay_log(run).snapshot()
    try:
        data = json.loads(run.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"run {str(run)!r} is neither a ledger snapshot (JSON) nor an event log") from exc
    if not isinstance(data, dict):
        raise ValueError(f"run {str(run)!r} does not hold a ledger snapshot object")
    return data


@app.command()
def gate(
    run: Annotated[
        Path, typer.Argument(help="ledger snapshot JSON, event log, run directory, or replica run (rank*/)")
    ],
    requests: Annotated[
        int | None, typer.Option("--requests", help="exact number of user requests required")
    ] = None,
) -> None:
    """Check the zero-criteria (logical ones on rank 0; every declared rank present and coupled); exit 0 only
    if every criterion passes (missing data fails, exit 1; an unreadable run exits 2)."""
    try:
        snaps = _load_run(run)
    except ValueError as exc:
        typer.echo(f"FAIL: {exc}", err=True)
        raise typer.Exit(2) from exc
    result = evaluate(snaps, n_user_requests=requests)
    for c in result.criteria:
        typer.echo(f"{'PASS' if c.passed else 'FAIL'}  {c.name:<32} {c.observed}")
    typer.echo(
        f"gate: {'PASS' if result.passed else 'FAIL'} ({sum(c.passed for c in result.criteria)}/"
        f"{len(result.criteria)} criteria)"
    )
    raise typer.Exit(result.exit_code)


@app.command()
def replay(
    log: Annotated[Path, typer.Argument(help="SQLite event log written by a Ledger")],
    check_against: Annotated[
        Path | None, typer.Option("--check-against", help="live STATE.json to compare")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write the rebuilt snapshot as JSON here")] = None,
) -> None:
    """Rebuild every account and slot from LOG and print a summary; compare field for field if asked."""
    try:
        ledger = replay_log(log)
    except ValueError as exc:
        typer.echo(f"FAIL: {exc}", err=True)
        raise typer.Exit(2) from exc
    s = ledger.summary()
    typer.echo(
        f"accounts={s['n_accounts']} user_requests={s['n_user_requests']} writes={s['n_written']} "
        f"reads={s['n_reads']} coverage={s['coverage']:.4f} delta_spent_max={s['delta_spent_max']:.7g} "
        f"auth_violations={s['n_auth_violations']} foreign_reads={s['n_read_foreign_owner']} "
        f"fail_closed={s['identity_fail_closed']} eprocess_log_m_max={s['eprocess']['log_m_max']}"
    )
    snap = ledger.snapshot()
    if out is not None:
        out.write_text(json.dumps(snap))
    if check_against is not None:
        try:
            live = json.loads(check_against.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            typer.echo(f"FAIL: cannot read {str(check_against)!r}: {exc}", err=True)
            raise typer.Exit(2) from exc
        diffs = diff_states(live, json.loads(json.dumps(snap)))
        for d in diffs[:50]:
            typer.echo(f"DIFF {d}")
        typer.echo("replay == live: " + ("yes" if not diffs else f"NO ({len(diffs)} fields differ)"))
        raise typer.Exit(0 if not diffs else 1)


@app.command()
def sentinel(
    slots: Annotated[int, typer.Option("--slots", help="M: slots the sentinel samples from")],
    r: Annotated[int, typer.Option("--r", help="draws per round (with replacement)")],
    bad: Annotated[int, typer.Option("--bad", help="B: corrupted slots")] = 1,
    delta: Annotated[float, typer.Option("--delta", help="allowed miss probability")] = 0.01,
) -> None:
    """Print n(δ) = ⌈ln δ / (r·ln(1 − B/M))⌉ and the latency table for M slots and r draws per round."""
    try:
        n = rounds_needed(bad, slots, r, delta)
    except ValueError as exc:
        typer.echo(f"FAIL: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"rounds to detect >=1 of B={bad} bad among M={slots} with r={r}, prob >= {1 - delta:g}: {n}")
    typer.echo(latency_table(slots, r, deltas=(0.1, 0.01, 0.001)))
