"""Every reference to a document in src/, tests/, benchmarks/, docs/ and the README resolves inside the repository.

A reference is a path ending in ``.md`` with an optional ``#anchor`` (``docs/math.md#tier-a-radius`` in code,
``[text](math.md#tier-a-radius)`` in a page). The file must exist in the repository (relative to the citing page
for links in docs, or to the repository root), and the anchor must be one of that page's headings (GitHub's slug)
or an explicit ``<a id="...">``. Numbered sections of documents kept outside the repository (``§4.2``,
``spec §11``) and paths into them (``../shared``, ``spec/``) are refused: the design lives in docs/
(``docs/spec.md``).
"""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("src", "tests", "benchmarks", "docs")
EXTRA = ("README.md", "CHANGELOG.md")

REF = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*(?:[\w.-]+/)*[\w.-]+\.md)(?:#([\w-]+))?")
LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")
OUTSIDE = re.compile(r"\.\./shared|/work/|shared/spec|(?<![\w-])spec/|\bspec §|§\s?\d")
URL = re.compile(r"https?://\S+")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
EXPLICIT = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _files() -> list[Path]:
    out = [ROOT / name for name in EXTRA if (ROOT / name).exists()]
    for top in SCANNED:
        out += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in {".py", ".md"} and "__pycache__" not in p.parts)
    return [p for p in out if p != Path(__file__).resolve()]  # this file plants broken references on purpose


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    found: set[str] = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code and (m := HEADING.match(line)):
            found.add(slug(m.group(1)))
        found.update(EXPLICIT.findall(line))
    return frozenset(found)


def _resolve(ref: str, cited_from: Path) -> Path | None:
    """The referenced file inside the repository, or ``None``."""
    bases = [cited_from.parent, ROOT] if cited_from.suffix == ".md" else [ROOT]
    for base in bases:
        target = (base / ref).resolve()
        if target.is_relative_to(ROOT) and target.is_file():
            return target
    return None


def problems(path: Path) -> list[str]:
    """Every unresolved or outside reference in ``path``, as ``file:line: message``."""
    out = []
    text = path.read_text(encoding="utf-8")
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for n, line in enumerate(text.splitlines(), 1):
        line = URL.sub("", line)  # web links are citations, not documents of the repository
        if m := OUTSIDE.search(line):
            out.append(f"{where}:{n}: refers outside the repository ({m.group(0)!r}); cite a docs/ section")
        for ref, anchor in REF.findall(line):
            if path.suffix == ".py" and re.search(f"""['"]{re.escape(ref)}['"]""", line):
                continue  # a file name the code writes or reads (a string literal of just the name), not a citation
            target = _resolve(ref, path)
            if target is None:
                out.append(f"{where}:{n}: {ref} does not exist in the repository")
            elif anchor and anchor not in anchors(target):
                out.append(f"{where}:{n}: {ref} has no section #{anchor}")
        if path.suffix == ".md":
            out += [
                f"{where}:{n}: no section #{a} on this page" for a in LOCAL_LINK.findall(line) if a not in anchors(path)
            ]
    return out


def test_every_reference_resolves_inside_the_repository():
    bad = [p for path in _files() for p in problems(path)]
    assert not bad, "broken document references:\n" + "\n".join(bad)


def test_the_design_pages_exist():
    for page in (
        "spec.md",
        "glossary.md",
        "math.md",
        "codecs.md",
        "read-path.md",
        "memory-meters.md",
        "ladder.md",
        "eviction.md",
        "contracts.md",
        "ledger.md",
        "architecture.md",
    ):
        assert (ROOT / "docs" / page).is_file(), page


def test_slug_matches_github():
    assert slug("2. Radii (`kvcert.bounds.radii`)") == "2-radii-kvcertboundsradii"
    assert slug("Replicas (`kvcert.serving.replicas`)") == "replicas-kvcertservingreplicas"
    honest = "when-measuring-beats-accumulating--the-honest-map"
    assert slug("When measuring beats accumulating — the honest map") == honest


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"""Tier A (``certificates.md`` §4.2)."""\n', "does not exist"),
        ('"""Radii (``docs/math.md#no-such-section``)."""\n', "no section #no-such-section"),
        ('"""See spec §11.4."""\n', "refers outside"),
        ("# design: ../shared/ARCHITECTURE.md\n", "refers outside"),
        ('"""(``docs/nowhere.md``)"""\n', "does not exist"),
    ],
)
def test_the_check_catches_a_planted_break(text, message, tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(text, encoding="utf-8")
    found = problems(planted)
    assert any(message in p for p in found), found


def test_a_file_name_in_code_is_not_a_citation(tmp_path):
    planted = tmp_path / "writer.py"
    planted.write_text('out = root / "summary.md"\n', encoding="utf-8")
    assert problems(planted) == []


def test_a_good_reference_passes(tmp_path):
    planted = tmp_path / "good.py"
    planted.write_text('"""Tier A (``docs/math.md#tier-a-radius``); (``docs/codecs.md``)."""\n', encoding="utf-8")
    assert problems(planted) == []


if __name__ == "__main__":  # print every problem, for fixing many at once
    sys.exit(print("\n".join(p for path in _files() for p in problems(path))))
