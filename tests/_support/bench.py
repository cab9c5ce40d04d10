"""What every benchmark's ``--quick --json`` run must print (``tests/benchmarks``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_quick(
    script: Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python script --quick --json`` from ``cwd`` (as users run it, from outside the
    repository), its output captured as text, at most 600 s."""
    return subprocess.run(
        [sys.executable, str(script), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )


def assert_table_then_json(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The run exited 0 and printed a table, then one JSON object last; returns it."""
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures
    table = (out.stdout + out.stderr).strip().splitlines()[:-1]
    assert len(table) >= 3, "no table printed before the JSON line"
    return figures


def run_json(
    script: Path, cwd: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """:func:`run_quick`, asserted to exit 0: the run and the JSON object it printed last."""
    out = run_quick(script, cwd, env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def quick_figures(script: Path, cwd: Path) -> dict[str, Any]:
    """The figures of ``script``'s quick run from ``cwd`` (a module fixture's): the
    test skips with the script's reason where it says it skipped; else the run printed
    its table, then the figures, last."""
    out, figures = run_json(script, cwd)
    if "skipped" in figures:
        import pytest

        pytest.skip(f"benchmarks/{script.name}: {figures['skipped']}")
    # What every benchmark prints (tests/benchmarks/test_benchmark_scripts.py leaves it here).
    assert assert_table_then_json(out) == figures
    return dict(figures)
