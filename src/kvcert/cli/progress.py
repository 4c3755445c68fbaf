"""Progress for long CLI loops: a rich bar on a terminal, one plain line per unit otherwise (logs, nohup)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(description: str, total: int, console: Console) -> Iterator[Callable[[int], None]]:
    """Yield a callback that marks one more unit of ``total`` done (its argument is ignored).

    A rich live bar only renders on a terminal; redirected output gets ``description: done/total (elapsed)``
    lines instead, so a long background run shows where it is.
    """
    if not console.is_terminal:
        start, done = time.monotonic(), 0

        def tick(_i: int) -> None:
            nonlocal done
            done += 1
            console.print(f"{description}: {done}/{total} ({time.monotonic() - start:.0f} s)", highlight=False)

        yield tick
        return
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
