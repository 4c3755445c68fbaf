"""Input errors, the one-line error contract (:func:`fail`) and the check of a one-file output, without the model
stack: the ledger's commands use them, and importing :mod:`kvcert.cli.validate` would load the models, the RULER
generators and numba with them (``vllm``'s kernel dispatcher trips over numba's loaded library when the same process
then starts an engine)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

#: the exit status of unusable input, the one click/typer give their own usage errors
EXIT_USAGE = 2


def fail(command: str, message: str) -> NoReturn:
    """Print ``kvcert <command>: error: <message>`` as one line on stderr and exit with :data:`EXIT_USAGE`."""
    line = " ".join(message.split())  # one line, whatever the message held
    typer.echo(f"kvcert {command}: error: {line}", err=True)
    raise typer.Exit(EXIT_USAGE)


class InputError(ValueError):
    """Unusable input (argument, input file or output location); the message names what is wrong."""


def out_file(path: Path, overwrite: bool, option: str = "--out") -> None:
    """Check a one-file output (``allocate``, ``probe run``, ``ledger replay``) before any work: ``ValueError`` naming
    ``option`` for a directory, a missing parent folder, a symbolic link, or an existing file without
    ``overwrite``."""
    if path.is_symlink():
        raise InputError(f"{option} {path} is a symbolic link: results are never written through a link")
    if path.is_dir():
        raise InputError(f"{option} {path} is a directory; give the path of the file to write")
    if not path.parent.is_dir():
        raise InputError(f"{option} {path}: the folder {path.parent} does not exist")
    if path.exists() and not overwrite:
        raise InputError(f"{option} {path} exists; pass --overwrite to replace it")
