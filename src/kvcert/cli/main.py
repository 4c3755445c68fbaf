"""The ``kvcert`` command line: ``run`` (the main job), ``audit``, ``eval``, ``ppl`` and the tool sub-apps."""

from __future__ import annotations

import importlib.util

import typer

from kvcert.cli.allocate import allocate
from kvcert.cli.audit import audit
from kvcert.cli.codecs import codecs
from kvcert.cli.evaluate import evaluate
from kvcert.cli.frontier import frontier
from kvcert.cli.merge import merge
from kvcert.cli.ppl import ppl
from kvcert.cli.probe import app as probe_app
from kvcert.cli.run import run
from kvcert.cli.serve import serve

app = typer.Typer(
    help="kvcert: certified, observable and repairable KV-cache compression.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("run")(run)
app.command("audit")(audit)
app.command("eval")(evaluate)
app.command("ppl")(ppl)
app.command("merge")(merge)
app.command("codecs")(codecs)
app.command("allocate")(allocate)
app.command("frontier")(frontier)
app.command("serve")(serve)
app.add_typer(probe_app, name="probe")
if importlib.util.find_spec("kvcert.cli.ledger_command") is not None:
    from kvcert.cli.ledger_command import app as ledger_app

    app.add_typer(ledger_app, name="ledger")


def main() -> None:
    """Console entry point (``kvcert = "kvcert.cli.main:main"``)."""
    app()
