"""Package layering of ``src/kvcert``, checked statically (``ast``) on every module: see
``docs/architecture.md#layering``.

* A package may import only packages of a strictly lower layer (:data:`LAYER`), so the graph has no cycle and
  ``bounds`` / ``contracts`` (layer 0) import nothing else of kvcert.
* ``transformers`` is imported only by :data:`TRANSFORMERS_OK` packages.
* No import inside a function (the usual way to dodge an import cycle), except the optional heavy third-party
  packages of :data:`LAZY_OK`, each with its reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcert"

#: Layer of every subpackage of kvcert: an import must go to a strictly lower layer (or stay in its package).
LAYER: dict[str, int] = {
    "bounds": 0,  # pure math
    "contracts": 0,  # pure Python: metrics, contracts, chains, tiers
    "quant": 1,  # codecs over bounds
    "probe": 1,  # probe snapshots and their acceptance gate (pure; the live drivers are integrations.live_probe)
    "models": 1,  # offline model loading (transformers, nothing of kvcert)
    "cache": 2,  # stores, gate, telemetry, events
    "kernels": 3,  # read-path kernels bound to the store's memory layout
    "evict": 3,  # eviction policies
    "attention": 4,  # certified read, ladder
    "ledger": 4,  # request-level risk ledger (observes cache events)
    "integrations": 5,  # transformers glue, memory-path adapters, live probe
    "serving": 6,  # batching server, replica ranks (a cache per batch + a ledger)
    "eval": 6,  # RULER / NIAH / perplexity harnesses
    "report": 6,  # tables, figures, HTML
    "cli": 7,  # the ``kvcert`` command line
}

#: Packages allowed to import transformers.
TRANSFORMERS_OK = {"integrations", "models", "eval", "cli", "serving"}

#: Third-party top-level modules that may be imported inside a function, with the reason.
LAZY_OK: dict[str, str] = {
    "long_context_eval": "RULER's generators, a data package installed --no-deps; needed only for RULER tasks",
    "nltk": "pulled in only to patch RULER's sentence splitter while a RULER generator runs",
    "triton": "optional GPU dependency, imported only when a Triton kernel is requested",
    "vllm": "lives in its own environment (.venv-vllm); the plugin entry point runs in every vLLM process and "
    "imports vLLM's registry only once KVCERT_VLLM=1 asks for the backend",
    "kvcert.kernels.triton_read": "imports triton at its top (optional GPU dependency): loaded only when the Triton "
    "backend serves a read",
    "kvcert.quant.logcode_numba": "imports numba at its top: loaded on the first fused log8 write, never with the "
    "cache package, which the vLLM plugin imports in every vLLM process (kvcert.quant.kernel_env)",
    "kvcert.quant.norms_numba": "imports numba at its top: loaded on the first fused norm of an entry served exact, "
    "never with the cache package (as kvcert.quant.logcode_numba)",
    "kvcert.quant.dither_numba": "imports numba at its top: loaded on the first dither drawn on the numba backend, "
    "never with the quant package, which the cache package imports (as kvcert.quant.logcode_numba)",
    "kvcert.quant.rtn_numba": "imports numba at its top: loaded on the first RTN write block encoded on the numba "
    "backend, never with the quant package (as kvcert.quant.dither_numba)",
}


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _package(path: Path) -> str | None:
    """The kvcert subpackage a module belongs to (``None`` for ``kvcert/__init__.py``, the public facade)."""
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else None


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module name of a ``from ... import`` (resolving relative imports against ``path``)."""
    if node.level == 0:
        return node.module or ""
    package = ["kvcert", *path.relative_to(SRC).parts[:-1]]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(tree: ast.AST, path: Path) -> list[tuple[ast.stmt, str]]:
    out: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node, _absolute(node, path)))
    return out


def _function_imports(tree: ast.AST, path: Path) -> list[tuple[ast.stmt, str]]:
    out: list[tuple[ast.stmt, str]] = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out += _imports(fn, path)
    return out


def _where(path: Path, node: ast.stmt) -> str:
    return f"{path.relative_to(SRC.parent)}:{node.lineno}"


def test_every_package_has_a_layer():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    missing = sorted(packages - set(LAYER))
    assert not missing, f"declare the layer of {missing} in tests/test_layering.py LAYER (and docs/architecture.md)"


def test_every_package_has_an_init_with_all():
    bad = []
    for init in [
        SRC / "__init__.py",
        *(d / "__init__.py" for d in SRC.rglob("*") if d.is_dir() and d.name != "__pycache__"),
    ]:
        if not init.is_file():
            bad.append(f"{init.parent.relative_to(SRC.parent)}: no __init__.py")
        elif not any(
            isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node).split("=")[0]
            for node in ast.parse(init.read_text(encoding="utf-8")).body
        ):
            bad.append(f"{init.relative_to(SRC.parent)}: no __all__")
    assert not bad, "\n".join(bad)


def test_imports_go_down_the_layers():
    bad = []
    for path in _modules():
        pkg = _package(path)
        if pkg is None:
            continue
        for node, module in _imports(ast.parse(path.read_text(encoding="utf-8")), path):
            parts = module.split(".")
            if parts[0] != "kvcert":
                continue
            if len(parts) == 1:
                bad.append(f"{_where(path, node)}: imports the kvcert facade (import the subpackage instead)")
                continue
            target = parts[1]
            if target == pkg or target not in LAYER:
                continue
            if LAYER[target] >= LAYER[pkg]:
                bad.append(f"{_where(path, node)}: {pkg} (layer {LAYER[pkg]}) imports {module} (layer {LAYER[target]})")
    assert not bad, "forbidden import edges:\n" + "\n".join(bad)


def test_transformers_only_in_glue_packages():
    bad = []
    for path in _modules():
        pkg = _package(path)
        for node, module in _imports(ast.parse(path.read_text(encoding="utf-8")), path):
            if module.split(".")[0] == "transformers" and pkg not in TRANSFORMERS_OK:
                bad.append(f"{_where(path, node)}: {pkg or 'kvcert'} imports {module}")
    assert not bad, "transformers outside " + str(sorted(TRANSFORMERS_OK)) + ":\n" + "\n".join(bad)


def test_no_imports_inside_functions():
    bad = []
    for path in _modules():
        for node, module in _function_imports(ast.parse(path.read_text(encoding="utf-8")), path):
            if module.split(".")[0] not in LAZY_OK and module not in LAZY_OK:
                bad.append(f"{_where(path, node)}: imports {module} inside a function")
    assert not bad, "move these imports to module level (or list an optional dependency in LAZY_OK):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "rule"),
    [
        ("from kvcert.cache.store import LayerStore\n", test_imports_go_down_the_layers),
        ("import transformers\n", test_transformers_only_in_glue_packages),
        ("def f():\n    from kvcert.bounds import rope\n", test_no_imports_inside_functions),
    ],
)
def test_the_checks_catch_a_planted_break(source, rule, monkeypatch, tmp_path):
    """Each check fails on a planted module ``bounds/planted.py`` that breaks its rule."""
    fake = tmp_path / "kvcert"
    for pkg in LAYER:
        (fake / pkg).mkdir(parents=True)
    (fake / "bounds" / "planted.py").write_text(source, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    with pytest.raises(AssertionError, match="planted"):
        rule()
