"""The main job, at reduced size: async GRPO refitting a real engine process through aiosync."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "async_grpo.py"

pytestmark = pytest.mark.slow


def run_example(tmp_path: Path, *args: str) -> dict[str, Any]:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--quiet", "--json-report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def assert_run_invariants(report: dict[str, Any]) -> None:
    committed = [int(r["version"]) for r in report["refits"]]
    # Every refit committed a strictly increasing version, the last one the final policy.
    assert committed, "no refit happened"
    assert all(a < b for a, b in itertools.pairwise(committed))
    assert committed[-1] == report["final_policy_version"] == report["final_weight_version"]
    assert report["refit_failures"] == 0
    # Engine weights equal the trainer's bit for bit at start and after every refit.
    assert report["verified"] == [[0, True]] + [[v, True] for v in committed]
    # Every used sample: target version <= policy version at use, never too stale.
    assert len(report["samples"]) == report["steps"] * 4
    for target, policy, staleness in report["samples"]:
        assert target <= policy
        assert staleness == policy - target
        assert staleness <= report["max_staleness"]
    used = {int(k): v for k, v in report["staleness_histogram"].items()}
    assert sum(used.values()) == len(report["samples"])


def test_async_grpo_colocated_ipc_keeps_engine_equal_to_trainer(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--colocated", "--steps", "4")
    assert report["synchronizer"] == "IPCWeightSynchronizer"
    assert report["final_policy_version"] == 4 * 2  # two optimizer steps per batch
    assert_run_invariants(report)


def test_async_grpo_not_colocated_collective_with_tight_staleness(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--no-colocated", "--steps", "3", "--max-staleness", "1")
    assert report["synchronizer"] == "CollectiveWeightSynchronizer"
    assert report["max_staleness"] == 1
    assert_run_invariants(report)


def test_async_grpo_sglang_http_test_server(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--backend", "sglang", "--steps", "2")
    assert report["synchronizer"] == "HTTPWeightSynchronizer"
    assert_run_invariants(report)
