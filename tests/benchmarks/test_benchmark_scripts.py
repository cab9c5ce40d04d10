"""Every benchmark script starts as a plain script and offers --quick and --json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("[!_]*.py"))


def test_benchmarks_exist():
    assert {p.stem for p in SCRIPTS} >= {
        "events",
        "refit_torch",
        "refit_jax",
        "ipc",
        "collective",
        "sglang_http",
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_script_runs_as_a_script(script):
    # Run as users do: the script's folder comes first on sys.path, so a
    # sibling named like a stdlib module would break every import of it.
    out = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent.parent,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--quick" in out.stdout and "--json" in out.stdout
