"""The built wheel holds one import package, ``aiosync``, and nothing at top level besides.

``refit`` and ``transports`` are also the import names of unrelated PyPI
distributions; the repository's folders of those names reach the wheel only as
``aiosync.refit`` / ``aiosync.transports`` (through the symlinks in ``aiosync/``).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_REPO = Path(__file__).resolve().parents[2]
_LINKED = ("transports", "refit", "engines")


@pytest.fixture(scope="module")
def wheel(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(clone)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (built,) = out.glob("aiosync-*.whl")
    return built


def test_aiosync_symlinks_point_at_the_top_level_folders() -> None:
    for name in _LINKED:
        link = _REPO / "aiosync" / name
        assert link.is_symlink(), f"aiosync/{name} must be a symlink to ../{name}"
        assert link.readlink() == Path("..") / name
    # The package folder setuptools builds and installs from (pyproject: package-dir).
    assert (_REPO / "src" / "aiosync").readlink() == Path("..") / "aiosync"


def test_wheel_has_only_aiosync_at_top_level(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    (dist_info,) = [t for t in top if t.endswith(".dist-info")]
    assert top == {"aiosync", dist_info}
    top_level = f"{dist_info}/top_level.txt"
    if top_level in names:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["aiosync"]


def test_wheel_carries_every_module_of_the_linked_folders(wheel: Path) -> None:
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    for name in _LINKED:
        for path in (_REPO / name).rglob("*.py"):
            relative = path.relative_to(_REPO).as_posix()
            assert f"aiosync/{relative}" in in_wheel, relative
            assert relative not in in_wheel, relative


def test_wheel_carries_aiosync_testing_and_no_test_modules(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {"aiosync/testing/__init__.py", "aiosync/testing/sglang_server.py"} <= set(names)
    # Test doubles users need live in aiosync.testing; pytest's test modules never ship.
    assert [n for n in names if Path(n).name.startswith("test_")] == []


def test_installed_wheel_imports_as_aiosync_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert sorted(p.name for p in target.iterdir() if p.name != "bin") == [
        "aiosync",
        wheel.name.split("-py3")[0] + ".dist-info",
    ]
    # -S: no site processing, so this environment's editable install (a .pth) is
    # not seen; its site-packages still provide torch, anyio, ...
    probe = """
import importlib.util, sys
import aiosync.transports.packing, aiosync.transports.ipc, aiosync.refit, aiosync.engines.sglang
assert aiosync.__file__.startswith(sys.argv[1]), aiosync.__file__
assert aiosync.transports.packing.__file__.startswith(sys.argv[1])
for name in ("transports", "refit", "engines"):
    assert importlib.util.find_spec(name) is None, name
print("ok")
"""
    path = f"{target}:{sysconfig.get_paths()['purelib']}:{sysconfig.get_paths()['platlib']}"
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(target)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
