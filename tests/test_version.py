"""The version has one source, ``kvcert.__version__``; pyproject.toml reads it (setuptools dynamic version)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kvcert

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"], "write the version only in src/kvcert/__init__.py"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvcert.__version__"}


def test_version_is_pep440_and_in_the_changelog():
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*", kvcert.__version__)
    assert f"## [{kvcert.__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
