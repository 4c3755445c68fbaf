"""Up-front checks of ``kvcert`` command-line inputs and outputs, and the one-line error contract.

Every command checks everything it was given *before* it loads a model, generates data or decodes:
numeric options against their ranges, the model spec (a known zoo name, ``tiny:<family>`` of a supported
family, or a local folder holding a transformers ``config.json`` of a supported family), codecs, RULER
tasks and their smallest context, the gate (a certified or risk-ranked gate needs a finite threshold
``>= 0``), ``--context`` against the model's ``max_position_embeddings``, and the output directory
(:func:`prepare_out`). Unusable input ends the command with **one line** on stderr,
``kvcert <command>: error: <what is wrong>``, and exit status 2, the status click/typer use for their own usage
errors (:func:`~kvcert.cli.output_checks.fail`). Nothing is written for a refused command.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvcert.cli.common import TINY_PREFIX
from kvcert.cli.output_checks import InputError, fail
from kvcert.eval import ruler
from kvcert.integrations.model_attention import SUPPORTED_FAMILIES as CACHE_FAMILIES
from kvcert.models.tiny import SUPPORTED_FAMILIES, tiny_config
from kvcert.models.zoo import ZOO, cache_root

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

REPORT_FILES = ("results.json", "report.html")


@contextmanager
def checked_inputs(command: str) -> Iterator[None]:
    """Turn a ``ValueError`` raised while checking inputs into :func:`fail`'s one line and exit status 2.

    Wrap only the checking and parsing of inputs: an error raised later (during decoding) is a defect to
    surface, not unusable input.
    """
    try:
        yield
    except ValueError as exc:
        fail(command, str(exc))


def at_least(name: str, value: int | float, minimum: int | float) -> None:
    """``ValueError`` naming ``--name`` unless ``value >= minimum`` (NaN fails)."""
    if not value >= minimum:
        raise InputError(f"--{name} must be >= {minimum}, got {value}")


SEED_MAX = 2**32 - 1  # RULER's generators and numpy's legacy seeding take seeds in [0, 2^32 − 1]


def seed_in_range(seed: int) -> None:
    """``ValueError`` naming ``--seed`` unless ``0 <= seed <= 2^32 − 1``, the range every seeded part of a run takes
    (a negative seed used to pass the checks and fail in RULER's generator after the model loaded)."""
    if not 0 <= seed <= SEED_MAX:
        raise InputError(f"--seed must be in [0, {SEED_MAX}], got {seed}")


def model_max_positions(spec: str) -> int | None:
    """Check a ``--model`` spec without loading weights; return its ``max_position_embeddings`` if known.

    Accepts ``tiny:<family>`` (supported families of :mod:`kvcert.models.tiny`), a zoo name (the limit is
    read from the converted folder's ``config.json`` when it exists, else ``None``: checked after loading)
    or a local folder with a tokenizer and a ``config.json`` whose ``model_type`` the certified cache supports. Raises
    ``ValueError`` naming ``--model`` otherwise.
    """
    if spec.startswith(TINY_PREFIX):
        family = spec[len(TINY_PREFIX) :]
        if family not in SUPPORTED_FAMILIES:
            raise InputError(
                f"--model: unsupported tiny family {family!r}; supported are "
                f"{', '.join(TINY_PREFIX + f for f in SUPPORTED_FAMILIES)}"
            )
        return int(tiny_config(family).max_position_embeddings)
    if spec in ZOO:
        done = sorted(cache_root().glob(f"models/{spec}-*/config.json"))
        return _config_positions(done[-1]) if done else None
    folder = Path(spec)
    if not folder.is_dir():
        raise InputError(
            f"--model: {spec!r} is not a known name ({', '.join(sorted(ZOO))}), tiny:<family>, "
            "or an existing local folder"
        )
    config = folder / "config.json"
    if not config.is_file():
        raise InputError(f"--model: folder {spec!r} is not a transformers model (no config.json)")
    if not (folder / "tokenizer_config.json").is_file():
        raise InputError(f"--model: folder {spec!r} holds no tokenizer (tokenizer_config.json)")
    model_type = _read_json(config, "--model").get("model_type")
    if model_type not in CACHE_FAMILIES:
        raise InputError(
            f"--model: {spec!r} has model_type {model_type!r}; the certified cache supports {', '.join(CACHE_FAMILIES)}"
        )
    return _config_positions(config)


def _read_json(path: Path, what: str) -> dict[str, object]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"{what}: cannot read {path}: {type(exc).__name__}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{what}: {path} does not hold a JSON object")
    return doc


def _config_positions(config: Path) -> int | None:
    doc = _read_json(config, "--model")
    text = doc.get("text_config")
    value = (text if isinstance(text, dict) else doc).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def context_fits(context: int, max_positions: int | None) -> None:
    """Refuse ``--context`` beyond the model's ``max_position_embeddings`` (positions past it are
    extrapolated RoPE: the numbers would describe a model outside its trained range). ``None``: unknown."""
    if max_positions is not None and context > max_positions:
        raise InputError(f"--context {context} exceeds the model's max_position_embeddings ({max_positions})")


def loaded_context_fits(context: int, positions: int | None, model: PreTrainedModel) -> None:
    """:func:`context_fits` again once ``model`` is loaded, where the limit was unknown before the load
    (``positions`` from :func:`model_max_positions` is ``None``: a zoo model converted by this load): against the
    loaded text config's ``max_position_embeddings``. A known ``positions`` was checked before loading."""
    if positions is None:
        context_fits(context, model.config.get_text_config().max_position_embeddings)


def ruler_tasks(tasks: Sequence[str], context: int, option: str = "--tasks") -> None:
    """Known RULER tasks, each at least its generator's smallest context (see ``ruler.MIN_CONTEXT``), listed once;
    ``option`` is the command's name for the list (``eval`` and ``audit`` call it ``--task``)."""
    if not tasks:
        raise InputError(f"{option}: no RULER task given")
    for task in tasks:
        if task not in ruler.TASK_NAMES:
            raise InputError(f"unknown RULER task {task!r}; supported are {', '.join(ruler.TASK_NAMES)}")
        if context < ruler.MIN_CONTEXT[task]:
            raise InputError(f"--context must be >= {ruler.MIN_CONTEXT[task]} tokens for {task}, got {context}")
    if len(set(tasks)) != len(tasks):
        raise InputError(f"{option} lists a task twice: {', '.join(tasks)}")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def prepare_out(out: Path, overwrite: bool, inputs: Sequence[Path] = ()) -> Path:
    """Check and create the report directory ``out`` before any work; return it.

    Refused (``ValueError``): ``out`` exists and is not a directory; it cannot be created or written (a
    probe file is created and removed); it already holds a report (:data:`REPORT_FILES`) and ``overwrite``
    is false; it holds a symbolic link (results are never written through a link); or it is, or contains,
    one of ``inputs`` (files this command reads). Every report file is then written atomically
    (:func:`kvcert.report.results.write_atomic`), which replaces a name and never follows a link.
    """
    resolved = out.resolve()
    for src in inputs:
        if _inside(src.resolve(), resolved):
            raise InputError(f"--out {out} is or contains the input {src}: it would be overwritten")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    if out.is_dir():
        links = sorted(p.name for p in out.iterdir() if p.is_symlink())
        if links:
            raise InputError(
                f"--out {out} holds symbolic link(s) {', '.join(links)}: results are never written "
                "through a link; remove them or choose another directory"
            )
        existing = [name for name in REPORT_FILES if (out / name).exists()]
        if existing and not overwrite:
            raise InputError(f"--out {out} already holds {', '.join(existing)}; pass --overwrite to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvcert-write-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"--out {out} is not a writable directory: {exc.strerror or type(exc).__name__}") from None
    return out


OverwriteOption = Annotated[bool, typer.Option(help="replace a report (results.json, report.html) already in --out")]
