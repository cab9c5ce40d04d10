"""A sharded (FSDP2, gloo) trainer on the collective transport, one rank failing
(issue 25, item 2): before, between and after its gathers, or SIGKILLed mid-sync.

Every surviving rank raises the same TransportError naming the failed rank, well
within ``sync_timeout_s`` (the ranks vote over the sync store, not in a group the
failed rank would have to finish its gathers for), every process exits, and
when the gathers stayed paired the next sync heals in the same processes.
Each rank runs ``_sharded_collective.py`` in its own process; rank 0 holds the engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._support.net import free_ports

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
REPO = HERE.parent.parent
#: Limit for a rank to exit, seconds: a hang fails the test instead of the session.
EXIT_LIMIT_S = 300


def _run(tmp: Path, world: int, scenario: str, failed: int) -> tuple[list[Any], list[int]]:
    """Every rank's JSON (None for a rank that wrote none) and exit code."""
    pg_port, store_port = free_ports(2)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_sharded_collective.py"),
                *map(str, (r, world, pg_port, store_port, tmp / f"{r}.json", scenario, failed)),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=(tmp / f"{r}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        codes: dict[int, int] = {}
        for r in [r for r in range(world) if r != failed] + [failed]:
            stdin = procs[r].stdin
            if r == failed and stdin is not None:
                stdin.close()  # the survivors exited: the failed rank may too
            try:
                codes[r] = procs[r].wait(timeout=EXIT_LIMIT_S)
            except subprocess.TimeoutExpired:
                log = (tmp / f"{r}.log").read_text()[-3000:]
                pytest.fail(f"rank {r} did not exit within {EXIT_LIMIT_S} s:\n{log}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seen = [
        json.loads(f.read_text()) if (f := tmp / f"{r}.json").exists() else None
        for r in range(world)
    ]
    return seen, [codes[r] for r in range(world)]


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("before", "rank 1 failed before tensor 0"),
        ("between", "rank 1 failed before tensor 3"),
        ("after", "rank 1 failed after its last tensor"),
    ],
)
def test_a_rank_failing_around_its_gathers_fails_every_rank_naming_it_and_all_exit(
    tmp_path: Path, scenario: str, message: str
) -> None:
    seen, codes = _run(tmp_path, 2, scenario, failed=1)
    assert codes == [0, 0], [(tmp_path / f"{r}.log").read_text()[-3000:] for r in range(2)]
    survivor, failed = seen
    assert survivor["failure"] == [
        "TransportError",
        f"trainer rank 1 raised InjectedError: {message}",
    ]
    assert failed["failure"] == ["InjectedError", message]
    assert [s["after_failure"] for s in seen] == [[2, 1, True]] * 2
    if scenario == "after":  # every gather completed: the same processes heal
        assert [s["after_heal"] for s in seen] == [[2, 2, False]] * 2
        assert survivor["healed_bit_exact"] is True


def test_a_rank_sigkilled_mid_sync_is_named_by_every_survivor_and_the_survivors_exit(
    tmp_path: Path,
) -> None:
    seen, codes = _run(tmp_path, 3, "kill", failed=2)
    assert codes == [0, 0, -signal.SIGKILL], [
        (tmp_path / f"{r}.log").read_text()[-3000:] for r in range(2)
    ]
    assert seen[2] is None
    failures = [s["failure"] for s in seen[:2]]
    assert failures[0] == failures[1]
    kind, text = failures[0]
    assert kind == "TransportError"
    assert text.startswith("trainer rank 2: stopped answering during the sync: no heartbeat")
    assert "a previous, timed-out sync" not in text
    assert [s["after_failure"] for s in seen[:2]] == [[2, 1, True]] * 2
