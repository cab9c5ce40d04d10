"""The README is a front door and the docs site builds: every link lands on a page and anchor.

``mkdocs build --strict`` (``mkdocs.yml``) fails on a page missing from the nav, a link to a
file or an anchor that does not exist, or a link out of ``docs/``. The README is not part of the
site, so its relative links are checked here against the files and their headings' anchors.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The issue's budget for the README: a pitch, install, the quick start, one table, links.
README_MAX_LINES = 150

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(page: Path) -> set[str]:
    """The ids python-markdown's toc (mkdocs') gives the page's headings, as GitHub does for
    plain-word headings."""
    from markdown.extensions.toc import slugify  # mkdocs' own dependency

    text = _FENCE.sub("", page.read_text())  # a `# comment` in a code block is no heading
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in _HEADING.findall(text)}


def _relative_links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_readme_fits_on_a_screen() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


def test_every_readme_link_resolves_to_a_file_and_anchor() -> None:
    links = _relative_links(README)
    assert "docs/transports.md" in links
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        dest = (README.parent / path) if path else README
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert broken == []


def test_the_readme_links_every_docs_page_it_summarises() -> None:
    # The README's sections moved to these pages; the README is their way in.
    linked = {t.partition("#")[0] for t in _relative_links(README)}
    for page in ("loop", "refit", "transports", "delta-fp8", "failures", "engines", "install"):
        assert f"docs/{page}.md" in linked, page


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = {p.parent.name for p in tmp_path.glob("*/index.html")}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages <= built, pages - built
