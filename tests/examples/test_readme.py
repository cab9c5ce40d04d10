"""The README's code runs as written: its blocks are read from the file, never copied here.

The docs pages' fragments compile and the names they give exist, as the README's do."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_DOTTED = re.compile(r"\b(aiosync(?:\.[A-Za-z_]\w*)+)")


def _python_blocks() -> list[str]:
    blocks = _BLOCK.findall(README.read_text())
    assert blocks, "the README has no python blocks"
    return blocks


def _scripts() -> list[str]:
    return [b for b in _python_blocks() if 'if __name__ == "__main__":' in b]


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not dotted.startswith(exc.name):
                raise  # an optional dependency is missing, not the README's name
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"nothing of {dotted} imports")


def test_the_readme_has_one_runnable_quick_start() -> None:
    assert len(_scripts()) == 1


@pytest.mark.slow
def test_the_quick_start_runs_and_the_engine_generates_like_the_trainer(tmp_path: Path) -> None:
    (script,) = _scripts()
    (tmp_path / "quickstart.py").write_text(script)
    proc = subprocess.run(
        [sys.executable, "quickstart.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # The script asserts greedy equality of engine and trainer after every refit.
    assert proc.returncode == 0, proc.stderr[-4000:]
    versions = re.findall(r"^step (\d+): weight_version (\d+)", proc.stdout, re.M)
    assert versions == [("0", "1"), ("1", "2"), ("2", "3")]


def test_every_readme_fragment_is_valid_async_python() -> None:
    for block in _python_blocks():
        compile(block, str(README), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_every_name_the_readme_gives_exists() -> None:
    names = sorted(set(_DOTTED.findall(README.read_text())))
    assert "aiosync.create_weight_synchronizer" in names
    missing = []
    for name in names:
        try:
            _resolve(name)
        except (AttributeError, AssertionError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_docs_fragment_is_valid_async_python(page: Path) -> None:
    for block in _BLOCK.findall(page.read_text()):
        compile(block, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_name_the_docs_give_exists(page: Path) -> None:
    missing = []
    for name in sorted(set(_DOTTED.findall(page.read_text()))):
        try:
            _resolve(name)
        except (AttributeError, AssertionError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []
