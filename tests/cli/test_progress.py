from __future__ import annotations

import io

from rich.console import Console

from kvcert.cli.progress import progress_bar


def test_redirected_output_gets_one_line_per_unit():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=120)
    with progress_bar("decoding 3 samples", 3, console) as tick:
        for i in range(3):
            tick(i)
    lines = buf.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"decoding 3 samples: {i}/3" for i in (1, 2, 3)]


def test_terminal_output_renders_a_bar():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with progress_bar("work", 2, console) as tick:
        tick(0)
        tick(1)
    assert "2/2" in buf.getvalue()
