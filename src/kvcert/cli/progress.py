"""Rich progress bars for long CLI loops."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(description: str, total: int, console: Console) -> Iterator[Callable[[int], None]]:
    """Yield a callback that marks one more unit of ``total`` done (its argument is ignored)."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda _i: bar.advance(task)
