"""Every benchmark runs as a plain script: --quick prints a table, --json a JSON line last."""

from __future__ import annotations

import json
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


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_quick_run_prints_a_table_and_one_json_object_last(script, tmp_path):
    if script.stem == "refit_jax":
        pytest.importorskip("jax")
    # Run as users do, from outside the repository: the script's folder comes
    # first on sys.path (a sibling named like a stdlib module would break it),
    # and nothing may be read from outside the installed project.
    out = subprocess.run(
        [sys.executable, str(script), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict) and figures
    table = (out.stdout + out.stderr).strip().splitlines()[:-1]
    assert len(table) >= 3, "no table printed before the JSON line"
