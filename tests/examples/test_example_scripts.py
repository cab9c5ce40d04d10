"""Each short example script runs on CPU and shows what it claims (subprocess, small sizes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_ipc_colocated_engine_generates_like_trainer_after_each_refit() -> None:
    out = run_script("ipc_colocated.py", "--steps", "2")
    lines = [line for line in out.splitlines() if line.startswith("IPCWeightSynchronizer")]
    assert [re.search(r"weight_version (\d+)", line)[1] for line in lines] == ["1", "2"]  # type: ignore[index]
    assert all(line.endswith("equal") for line in lines)


def test_collective_every_worker_generates_like_trainer_after_each_refit() -> None:
    out = run_script("collective.py", "--steps", "2")
    lines = [line for line in out.splitlines() if line.startswith("CollectiveWeightSynchronizer")]
    assert [re.search(r"weight_version (\d+)", line)[1] for line in lines] == ["1", "2"]  # type: ignore[index]
    assert all(line.endswith("equal") for line in lines)


def test_nnx_qwen3_refits_bit_exact_and_the_engine_decodes_like_jax() -> None:
    pytest.importorskip("flax")
    out = run_script("nnx_qwen3.py", "--steps", "2")
    lines = [line for line in out.splitlines() if line.startswith("weight_version")]
    assert [line.split(":")[0] for line in lines] == ["weight_version 1", "weight_version 2"]
    assert all("25 tensors bit-exact" in line and line.endswith("equal") for line in lines)


def test_replay_subscriber_drops_rollouts_beyond_max_staleness() -> None:
    out = run_script("replay_subscriber.py", "--steps", "4")
    trained = re.findall(r"train on a rollout of v(\d+) \(staleness (\d+)\)", out)
    assert trained == [("0", "0"), ("0", "1"), ("2", "0"), ("2", "1")]
    assert re.findall(r"event COMMITTED +version (\d+)", out) == ["2", "4"]
    assert "dropped as too stale: 4 {2: 4}" in out


def test_sglang_http_server_generates_like_trainer_and_reports_our_version() -> None:
    out = run_script("sglang_http.py", "--steps", "2")
    lines = [line for line in out.splitlines() if line.startswith("HTTPWeightSynchronizer")]
    versions = [re.search(r"weight_version (\d+) \(server reports '(\d+)'\)", x) for x in lines]
    assert [(m[1], m[2]) for m in versions if m] == [("1", "1"), ("2", "2")]
    assert all(line.endswith("equal") for line in lines)
