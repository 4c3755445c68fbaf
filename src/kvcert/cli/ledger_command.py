"""``kvcert ledger``: gate a run on the zero-criteria, replay an event log, print sentinel latencies."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcert.cli.output_checks import fail, out_file
from kvcert.ledger.criteria import Criterion, GateResult, check_snapshot, evaluate
from kvcert.ledger.log import LogReader
from kvcert.ledger.replay import diff_states, replay_verified
from kvcert.ledger.sentinel import latency_table, rounds_needed
from kvcert.strict_json import loads as strict_loads

app = typer.Typer(help="Request-level risk ledger: gate, replay, sentinel.", no_args_is_help=True)

_SQLITE_MAGIC = b"SQLite format 3\x00"
EXPECT_HEAD_HELP = "SEQ:HASH of the log's head recorded outside the log (at close): the log must end there"


def _integrity(reader: LogReader, expect_head: str | None) -> list[Criterion]:
    """``log_integrity`` (chained, verified and closed) and, if given, ``log_head==expected``."""
    out = [Criterion("log_integrity", reader.chained and reader.closed, reader.describe())]
    if expect_head is not None:
        head = f"{reader.seq}:{reader.prev.hex()}"
        out.append(Criterion("log_head==expected", head == expect_head.strip().lower(), f"head {head}"))
    return out


def _load_run(run: Path, expect_head: str | None = None) -> tuple[list[dict[str, Any]], list[Criterion]]:
    """The snapshots of a run and its evidence criteria: one run (see :func:`_load`), or one per rank of a
    replica run directory that holds ``rank{r}/`` subdirectories (:mod:`kvcert.serving.replicas`)."""
    if run.is_dir() and not any((run / name).is_file() for name in ("ledger.json", "ledger.db")):
        ranks = sorted((p for p in run.iterdir() if p.is_dir() and re.fullmatch(r"rank\d+", p.name)), key=str)
        if ranks:
            if expect_head is not None:
                raise ValueError("--expect-head names one log's head; gate each rank's ledger.db on its own")
            loaded = [_load(p, None) for p in ranks]
            evidence = [
                Criterion(f"{p.name}: {c.name}", c.passed, c.observed)
                for p, (_, cs) in zip(ranks, loaded, strict=True)
                for c in cs
            ]
            return [snap for snap, _ in loaded], evidence
    snap, evidence = _load(run, expect_head)
    return [snap], evidence


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = strict_loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"run {str(path)!r} is neither a ledger snapshot (JSON) nor an event log: {exc}") from None
    return check_snapshot(data, str(path))


def _load(run: Path, expect_head: str | None) -> tuple[dict[str, Any], list[Criterion]]:
    """A snapshot from a JSON file, a run directory holding ``ledger.json`` / ``ledger.db``, or a log, with
    its evidence criteria: a log is verified (:class:`~kvcert.ledger.log.LogReader`; a tampered one raises)
    and must be chained and closed; a directory holding both files is gated on ``ledger.json``, which must
    equal the replay of ``ledger.db``. A bare JSON snapshot carries no evidence criterion."""
    if run.is_dir():
        json_file, log_file = run / "ledger.json", run / "ledger.db"
        if json_file.is_file() and log_file.is_file():
            snap = _read_json(json_file)
            ledger, reader = replay_verified(log_file)
            diffs = diff_states(snap, json.loads(json.dumps(ledger.snapshot())))
            same = Criterion(
                "ledger.json==replay(ledger.db)",
                not diffs,
                "identical" if not diffs else f"{len(diffs)} field(s) differ: " + "; ".join(diffs[:3]),
            )
            return snap, [*_integrity(reader, expect_head), same]
        for f in (json_file, log_file):
            if f.is_file():
                return _load(f, expect_head)
        raise ValueError(f"run directory {str(run)!r} holds neither ledger.json, ledger.db nor rank*/ directories")
    if not run.is_file():
        raise ValueError(f"run {str(run)!r} does not exist")
    with run.open("rb") as fh:
        head = fh.read(16)
    if head == _SQLITE_MAGIC:
        ledger, reader = replay_verified(run)
        return ledger.snapshot(), _integrity(reader, expect_head)
    if expect_head is not None:
        raise ValueError("--expect-head needs an event log (ledger.db), not a JSON snapshot")
    return _read_json(run), []


@app.command()
def gate(
    run: Annotated[
        Path, typer.Argument(help="ledger snapshot JSON, event log, run directory, or replica run (rank*/)")
    ],
    requests: Annotated[
        int | None, typer.Option("--requests", help="exact number of user requests required", min=0)
    ] = None,
    expect_head: Annotated[str | None, typer.Option("--expect-head", help=EXPECT_HEAD_HELP)] = None,
) -> None:
    """Check the zero-criteria (logical ones on rank 0; every declared rank present and coupled) and, for an
    event log, its integrity (chain verified, log closed); exit 0 only if every criterion passes (missing
    data, an unchained legacy log or an unclosed log fail, exit 1); a run that cannot be read, is malformed
    or whose hash chain does not verify exits 2 with one line naming the problem."""
    try:
        snaps, evidence = _load_run(run, expect_head)
        result = evaluate(snaps, n_user_requests=requests)
    except ValueError as exc:
        fail("ledger gate", str(exc))
    result = GateResult(result.criteria + tuple(evidence))
    if not evidence:
        typer.echo("NOTE  a bare JSON snapshot is not tamper-evident: gate its event log or run directory")
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
    check_against: Annotated[Path | None, typer.Option("--check-against", help="live STATE.json to compare")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write the rebuilt snapshot as JSON here")] = None,
    expect_head: Annotated[str | None, typer.Option("--expect-head", help=EXPECT_HEAD_HELP)] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace a file already at --out")] = False,
) -> None:
    """Verify LOG's hash chain, rebuild every account and slot from it and print a summary and the
    integrity line; compare field for field if asked. Exit 2 for an unreadable, malformed or tampered log,
    1 if the log is not verified end to end (legacy, not closed, head differs) or differs from STATE."""
    try:
        if out is not None:
            out_file(out, overwrite)  # before the log is read: a bad --out costs nothing
        ledger, reader = replay_verified(log)
        live = None if check_against is None else check_snapshot(strict_loads(check_against.read_text()))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        fail("ledger replay", str(exc))
    s = ledger.summary()
    typer.echo(
        f"accounts={s['n_accounts']} user_requests={s['n_user_requests']} writes={s['n_written']} "
        f"reads={s['n_reads']} coverage={s['coverage']:.4f} delta_spent_max={s['delta_spent_max']:.7g} "
        f"auth_violations={s['n_auth_violations']} foreign_reads={s['n_read_foreign_owner']} "
        f"fail_closed={s['identity_fail_closed']} eprocess_log_m_max={s['eprocess']['log_m_max']}"
    )
    typer.echo(  # the tiers of the line above, as the ledger's Prometheus gauges label them (kvcert.ledger.metrics)
        "tiers: coverage empirical (share of reads served compressed); every count, delta_spent_max and the "
        "e-process certified (ledger-decided)"
    )
    integrity = _integrity(reader, expect_head)
    for c in integrity:
        typer.echo(f"integrity: {'PASS' if c.passed else 'FAIL'} {c.observed}")
    snap = ledger.snapshot()
    if out is not None:
        out.write_text(json.dumps(snap))
    same = True
    if live is not None:
        diffs = diff_states(live, json.loads(json.dumps(snap)))
        for d in diffs[:50]:
            typer.echo(f"DIFF {d}")
        typer.echo("replay == live: " + ("yes" if not diffs else f"NO ({len(diffs)} fields differ)"))
        same = not diffs
    raise typer.Exit(0 if same and all(c.passed for c in integrity) else 1)


@app.command()
def sentinel(
    slots: Annotated[int, typer.Option("--slots", help="M: slots the sentinel samples from (1 … 2^62)")],
    r: Annotated[int, typer.Option("--r", help="draws per round, with replacement (1 … 2^62)")],
    bad: Annotated[int, typer.Option("--bad", help="B: corrupted slots (1 … M)")] = 1,
    delta: Annotated[float, typer.Option("--delta", help="allowed miss probability")] = 0.01,
) -> None:
    """Print the smallest n with (1 − B/M)^(r·n) ≤ δ, n(δ) = ⌈ln δ / (r·ln(1 − B/M))⌉, and the latency table for
    M slots and r draws per round; out-of-range arguments exit 2 with one line."""
    try:
        n = rounds_needed(bad, slots, r, delta)
    except ValueError as exc:
        fail("ledger sentinel", str(exc))
    typer.echo(f"rounds to detect >=1 of B={bad} bad among M={slots} with r={r}, prob >= {1 - delta:g}: {n}")
    typer.echo(latency_table(slots, r, deltas=(0.1, 0.01, 0.001)))
