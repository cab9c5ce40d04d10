"""Every benchmark runs as a plain script: --quick prints a table, --json a JSON line last."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.bench import assert_table_then_json, run_quick

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("[!_]*.py"))
#: Benchmarks whose ``--quick --json`` run a module of their own checks, this
#: file's check (``assert_table_then_json``) among them: not run twice.
CHECKED_APART = {"delta", "many_senders", "plan_check"}


def test_benchmarks_exist():
    assert {p.stem for p in SCRIPTS} >= {
        "events",
        "refit_torch",
        "refit_jax",
        "ipc",
        "collective",
        "sglang_http",
        *CHECKED_APART,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [p for p in SCRIPTS if p.stem not in CHECKED_APART], ids=lambda p: p.stem
)
def test_benchmark_quick_run_prints_a_table_and_one_json_object_last(script, tmp_path):
    if script.stem == "refit_jax":
        pytest.importorskip("jax")
    # Run as users do, from outside the repository: the script's folder comes
    # first on sys.path (a sibling named like a stdlib module would break it),
    # and nothing may be read from outside the installed project.
    assert_table_then_json(run_quick(script, tmp_path))
