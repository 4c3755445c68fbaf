"""``tools/link_installed.py``: seeds a virtual environment with hard links to another one's installed files."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "link_installed.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("link_installed", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


link_installed = _tool()


def _venv(root: Path, python: str = "python3.11") -> Path:
    site = root / "lib" / python / "site-packages"
    site.mkdir(parents=True)
    return site


def _install(site: Path, name: str = "Demo_Pkg", version: str = "1.2") -> None:
    """A distribution as pip writes it: a package, a console script outside site-packages, dist-info with RECORD."""
    (site / "demo_pkg").mkdir()
    (site / "demo_pkg" / "__init__.py").write_text("VALUE = 7\n")
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(
        "demo_pkg/__init__.py,sha256=abc,10\n"
        "demo_pkg/__pycache__/__init__.cpython-311.pyc,,\n"  # listed, never written: must be tolerated
        "../../../bin/demo,sha256=def,20\n"
        f"{name}-{version}.dist-info/METADATA,,\n"
        f"{name}-{version}.dist-info/RECORD,,\n"
    )


def test_links_site_packages_files_and_rewrites_record(tmp_path: Path) -> None:
    src, dst = _venv(tmp_path / "a"), _venv(tmp_path / "b")
    _install(src)
    source_record = (src / "Demo_Pkg-1.2.dist-info" / "RECORD").read_text()

    assert link_installed.link_distribution(src, dst, "demo-pkg") == 2  # the module and METADATA

    assert os.path.samefile(src / "demo_pkg" / "__init__.py", dst / "demo_pkg" / "__init__.py")
    record = dst / "Demo_Pkg-1.2.dist-info" / "RECORD"
    assert not os.path.samefile(src / "Demo_Pkg-1.2.dist-info" / "RECORD", record)  # a fresh file
    assert "../../../bin/demo" not in record.read_text()
    assert "demo_pkg/__init__.py,sha256=abc,10" in record.read_text()
    assert (src / "Demo_Pkg-1.2.dist-info" / "RECORD").read_text() == source_record  # source untouched
    assert not (tmp_path / "b" / "bin").exists()
    (found,) = importlib.metadata.distributions(path=[str(dst)])
    assert (found.metadata["Name"], found.version) == ("Demo_Pkg", "1.2")


def test_skips_missing_and_already_present(tmp_path: Path) -> None:
    src, dst = _venv(tmp_path / "a"), _venv(tmp_path / "b")
    _install(src)
    assert link_installed.link_distribution(src, dst, "not-installed") == 0
    _install(dst, version="9.0")
    assert link_installed.link_distribution(src, dst, "demo_pkg") == 0
    assert (dst / "demo_pkg" / "__init__.py").stat().st_ino != (src / "demo_pkg" / "__init__.py").stat().st_ino


def test_main_refuses_a_different_python(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = _venv(tmp_path / "a", "python3.11"), _venv(tmp_path / "b", "python3.12")
    _install(src)
    assert link_installed.main([str(tmp_path / "a"), str(tmp_path / "b"), "demo-pkg"]) == 0
    assert "nothing linked" in capsys.readouterr().out
    assert not (dst / "demo_pkg").exists()


def test_main_without_source_links_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _venv(tmp_path / "b")
    assert link_installed.main([str(tmp_path / "missing"), str(tmp_path / "b"), "torch"]) == 0
    assert "installs torch in full" in capsys.readouterr().out


def test_main_names_a_broken_environment(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _venv(tmp_path / "b")
    with pytest.raises(SystemExit, match="expected one lib/python"):
        link_installed.main([str(tmp_path / "a"), str(tmp_path / "b"), "torch"])
