"""``examples/sharded.py`` under torchrun: a 2-rank FSDP2 trainer refits the engine, and the
engine's greedy tokens equal the sharded trainer's after every refit (IPC and collective)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run_torchrun(*args: str) -> str:
    """``torchrun --nproc-per-node 2 examples/sharded.py ARGS``; its stdout. ``--standalone``
    rendezvouses on a free port, so parallel runs do not meet on torchrun's default 29500."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "sharded.py"),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize(
    ("flag", "kind"),
    [("--colocated", "IPCWeightSynchronizer"), ("--no-colocated", "CollectiveWeightSynchronizer")],
)
def test_sharded_trainer_refits_engine_to_trainer_tokens_on_every_step(
    flag: str, kind: str
) -> None:
    out = run_torchrun(flag, "--steps", "2")
    # Rank 0 alone holds the engine and prints; one line per step.
    lines = [line for line in out.splitlines() if line.startswith(kind)]
    assert [re.search(r"step (\d+): weight_version (\d+)", x).groups() for x in lines] == [  # type: ignore[union-attr]
        ("0", "1"),
        ("1", "2"),
    ]
    assert all(line.endswith("equal") for line in lines), lines
    # Both engine workers (one per rank's device when colocated) answered like the trainer.
    for line in lines:
        workers = re.search(r"workers (\[\[.*\]\])  trainer (\[.*?\])", line)
        assert workers is not None
        assert json.loads(workers[1]) == [json.loads(workers[2])] * 2
