"""The ``kvcert`` command line (typer); ``kvcert.cli.main:main`` is the console entry point."""

__all__ = ["main"]
