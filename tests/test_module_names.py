"""A module's file name means one thing across ``src/kvcert`` (``docs/architecture.md#module-names``).

Two modules with the same file name and different meanings (the ledger's zero-criteria ``gate.py`` beside the
cache's repair ``gate.py``; the ledger's request ``identity.py`` beside the ``none`` codec's ``identity.py``) make
a reader open the wrong file, and make ``from ... import gate`` ambiguous in a review. The rule checked here:

* no two modules share a file name, except ``__init__.py`` (every package has one: it is the package itself);
* three *role names* may repeat because they mean the same thing in every package that has them, and only at
  the paths listed in :data:`ROLE_NAMES` (a new one is a decision, made by adding it here with its role):

  - ``base.py``: the interface every peer of the package implements (the codec, the eviction scorer);
  - ``registry.py``: the package's peers looked up by name (codecs; metrics with their tier);
  - ``events.py``: the event records the package emits (the cache's write/read events to observers; the
    ledger's state-change events that its log stores and replay re-applies).

Pure math in ``bounds/`` and the module that applies it elsewhere do **not** share a role: they take different
names (``bounds/pooling.py`` the pooling contract vs ``integrations/pooled_attention.py`` serving pooled memory,
``bounds/budget.py`` the budget split vs ``ledger/request_budget.py`` the per-request account). A CLI command
module is named ``<command>_command.py`` when the command's name is also a module of the library.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcert"

#: The only file names besides ``__init__.py`` allowed to repeat, each at exactly these paths (same role).
ROLE_NAMES: dict[str, frozenset[str]] = {
    "base.py": frozenset({"evict/base.py", "quant/base.py"}),
    "registry.py": frozenset({"contracts/registry.py", "quant/registry.py"}),
    "events.py": frozenset({"cache/events.py", "ledger/events.py"}),
}


def _by_name(root: Path) -> dict[str, set[str]]:
    """File name -> every module path (relative to ``root``, POSIX) with that name."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        if "__pycache__" not in path.parts:
            out[path.name].add(path.relative_to(root).as_posix())
    return out


def repeated_names(root: Path) -> list[str]:
    """Every file name under ``root`` held by two or more modules against the rule above, with the paths."""
    bad = []
    for name, paths in sorted(_by_name(root).items()):
        if name == "__init__.py" or len(paths) < 2:
            continue
        allowed = ROLE_NAMES.get(name, frozenset())
        if not paths <= allowed:
            bad.append(f"{name}: {sorted(paths)} (allowed: {sorted(allowed) or 'none'})")
    return bad


def test_no_two_modules_share_a_name() -> None:
    assert repeated_names(SRC) == []


def test_role_names_are_where_they_are_declared() -> None:
    """A listed role path that no longer exists is a stale exception: remove it from :data:`ROLE_NAMES`."""
    found = _by_name(SRC)
    for name, paths in ROLE_NAMES.items():
        assert found[name] == set(paths), name


def test_the_rule_catches_a_repeat(tmp_path: Path) -> None:
    """The check fails on a repeated name (the layout before the renames) and on a role name at a new path."""
    for rel in ("cache/gate.py", "ledger/gate.py", "quant/base.py", "evict/base.py", "kernels/base.py", "a/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for pkg in ("cache", "ledger", "quant", "evict", "kernels", "a"):
        (tmp_path / pkg / "__init__.py").write_text("")
    bad = repeated_names(tmp_path)
    assert len(bad) == 2
    assert bad[0].startswith("base.py: ['evict/base.py', 'kernels/base.py', 'quant/base.py']")
    assert bad[1].startswith("gate.py: ['cache/gate.py', 'ledger/gate.py']")
