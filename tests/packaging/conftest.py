"""Packaging tests build and install from a copy of the repository, so that no
``build/`` or egg-info lands in the working tree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_SKIP = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "out"
)


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repository (symlinks kept) in a folder named ``aiosync``, the
    name ``git clone`` gives it; its parent folder holds nothing else."""
    dest = tmp_path_factory.mktemp("clone") / "aiosync"
    shutil.copytree(REPO, dest, symlinks=True, ignore=_SKIP)
    return dest
