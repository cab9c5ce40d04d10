"""An editable install (``pip install -e .``, as ``make setup`` does) is what a
script beside the clone imports (C44).

A clone is a folder named ``aiosync`` with no ``__init__.py``. A script saved next
to it runs with the clone's parent as ``sys.path[0]``, where Python's path finder
sees a namespace package ``aiosync``; setuptools' editable finder for a flat layout
is consulted after that one, so the namespace package won and every name was
missing (``module 'aiosync' has no attribute 'EmbeddedEngine'``). With
``src/aiosync`` (a link to ``aiosync/``) as the package folder, the install is a
static path entry, ``src/``, and a regular package anywhere on ``sys.path`` beats
namespace portions.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_PROBE = """
import importlib.util
import aiosync
import aiosync.transports.packing
print(aiosync.__file__)
print(aiosync.transports.packing.__file__)
print(aiosync.WeightSynchronizer.__module__)
# The path entry the install adds holds the package and nothing else.
print([n for n in ("transports", "refit", "engines") if importlib.util.find_spec(n)])
"""


@pytest.fixture(scope="module")
def python(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv holding an editable install of ``clone``."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    # This environment's packages (torch, anyio, setuptools to build with) as plain
    # path lines: Python does not read the .pth files of a folder named in a .pth,
    # so this environment's own install of aiosync stays out of sight.
    paths = sysconfig.get_paths()
    Path(site, "dependencies.pth").write_text(f"{paths['purelib']}\n{paths['platlib']}\n")
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(clone),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python


def _run_beside_clone(python: Path, clone: Path, script: str) -> list[str]:
    path = clone.parent / "myscript.py"
    path.write_text(script)
    out = subprocess.run(
        [python, path.name],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=clone.parent,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_script_beside_the_clone_imports_the_installed_package(python: Path, clone: Path) -> None:
    package = clone / "src" / "aiosync"
    assert _run_beside_clone(python, clone, _PROBE) == [
        str(package / "__init__.py"),
        str(package / "transports" / "packing.py"),
        "aiosync.synchronizer",
        "[]",
    ]


def test_editable_install_sees_a_module_added_after_it(python: Path, clone: Path) -> None:
    # src/aiosync is a link, not a copy: edits and new files need no reinstall.
    (clone / "aiosync" / "_added_after_install.py").write_text("ANSWER = 42\n")
    script = "from aiosync._added_after_install import ANSWER\nprint(ANSWER)\n"
    assert _run_beside_clone(python, clone, script) == ["42"]
