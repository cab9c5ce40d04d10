"""``examples/ray_grpo.py`` runs the async GRPO loop with the trainer and the engines as
Ray actors, against a running cluster (``--address``: this session's), colocated (IPC)
and not (the collective broadcast into a fleet of two engine actors), and prints the
summary of ``examples/async_grpo.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_grpo.py"

pytestmark = pytest.mark.slow

#: The engine's log-probs equal the trainer's up to float32 rounding (as in async_grpo).
ONPOLICY_LOGPROB_ATOL = 1e-5


@pytest.mark.parametrize(
    ("flags", "synchronizer", "where"),
    [
        ([], "IPCWeightSynchronizer", "colocated"),
        (["--no-colocated", "--engines", "2"], "CollectiveWeightSynchronizer", "not colocated"),
    ],
    ids=["colocated", "fleet-not-colocated"],
)
def test_the_ray_example_trains_and_every_refit_lands_on_the_engine_actors(
    ray_cluster: Any, tmp_path: Path, flags: list[str], synchronizer: str, where: str
) -> None:
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "report.json"
    command = [sys.executable, str(EXAMPLE), "--quick", "--address", address]
    proc = subprocess.run(
        [*command, "--json-report", str(out), *flags],
        cwd=ROOT,
        env=dict(os.environ),  # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: loopback (conftest)
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["synchronizer"] == synchronizer
    # 4 batches of 2 optimizer steps; a refit before each batch and after the last.
    assert (report["final_policy_version"], report["final_weight_version"]) == (8, 8)
    committed = [int(r["version"]) for r in report["refits"]]
    assert committed == sorted(set(committed)) and committed[-1] == 8
    assert report["refit_failures"] == 0
    assert [int(v) for v, _ in report["verified"]] == [0, *committed]
    assert all(equal for _, equal in report["verified"])  # engine == trainer, bit for bit
    assert all(0 <= staleness <= report["max_staleness"] for *_, staleness in report["samples"])
    assert len(report["samples"]) == 16  # 4 batches of 4 groups
    assert report["onpolicy_tokens"] > 0
    assert report["onpolicy_logprob_diff_max"] < ONPOLICY_LOGPROB_ATOL
    lines = proc.stderr.splitlines()
    # The driver shows the trainer actor's progress as it goes (stderr is a pipe here:
    # a whole line per step, as examples/async_grpo.py prints).
    steps = [re.split(" {2,}", line)[:4] for line in lines if line.startswith("step ")]
    assert steps == [
        ["step", f"{n}/4", f"reward {r:.3f}", f"policy v{2 * n} (2 optimizer steps/batch)"]
        for n, r in enumerate(report["rewards"], start=1)
    ], proc.stderr[-2000:]
    summary = f"{synchronizer} (embedded, Ray actors, {where}): 4 steps in "
    assert any(line.startswith(summary) for line in lines), proc.stderr[-2000:]
    assert any(
        line.startswith("refits: ") and line.endswith("after every refit: True") for line in lines
    )
