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


def test_metrics_port_serves_refit_and_staleness_metrics() -> None:
    import importlib.util
    import socket

    import httpx

    spec = importlib.util.spec_from_file_location("async_grpo_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up
    spec.loader.exec_module(example)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = example._Metrics(port)
    metrics.refit(1000, 0.5)
    metrics.refit(24, 0.25)
    metrics.failure()
    for steps in (0, 2, 2):
        metrics.staleness(steps)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("aiosync_"))
    assert float(values["aiosync_refit_bytes_total"]) == 1024
    assert float(values["aiosync_refit_seconds_sum"]) == 0.75
    assert float(values["aiosync_refit_failures_total"]) == 1
    assert float(values['aiosync_sample_staleness_bucket{le="1.0"}']) == 1
    assert float(values["aiosync_sample_staleness_count"]) == 3
