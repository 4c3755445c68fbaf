"""``kvcert.contracts`` is pure Python: it imports only the standard library and itself."""

import ast
import sys
from pathlib import Path

import kvcert.contracts

PACKAGE = Path(kvcert.contracts.__file__).parent


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module or "")
    return roots


def test_contracts_import_only_stdlib_and_themselves():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for module in _imported_roots(path):
            top = module.split(".")[0]
            assert module.startswith("kvcert.contracts") or top in sys.stdlib_module_names or top == "__future__", (
                f"{path.name} imports {module}"
            )
