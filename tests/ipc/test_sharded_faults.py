"""A sharded colocated trainer whose one rank fails: every rank fails alike, the
engine never serves a half-loaded or mislabelled version, the next sync heals.

Real processes: N FSDP2 ranks over gloo (``_sharded_faults.py``, one process
each; rank 0 holds an N-worker embedded engine, worker r paired to rank r).
The fault is injected on the last rank's second sync before, between and after
its gathers, in its clean-up after every worker committed, or by SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import start_script

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
_REPO = HERE.parents[1]
#: The longest a whole job of 3 syncs may take before it counts as hung, seconds.
_JOB_LIMIT_S = 600
#: What the injected fault's message starts with, per scenario.
_FAULT = {
    "before": "before: the source failed at tensor 0",
    "between": "between: the source failed at tensor 4",
    "after": "after: the source failed after its last tensor",
    "offload": "offload: offload_after_refit failed",
}


def _job(out: Path, world: int, scenario: str) -> tuple[list[int | None], list[dict[str, Any]]]:
    """Run every rank of one job; returns each rank's exit code and what it saw
    (``{}`` for a rank that wrote nothing). A rank still running after
    :data:`_JOB_LIMIT_S` is killed and its exit code is None."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out.mkdir(parents=True, exist_ok=True)
    script = HERE / "_sharded_faults.py"
    files = [out / f"{r}.log" for r in range(world)]
    # Each rank a process of its own, forked from the preloaded forkserver.
    procs = [
        start_script(
            script, [str(r), str(world), str(port), str(out / f"{r}.json"), scenario], files[r], env
        )
        for r in range(world)
    ]
    codes: list[int | None] = []
    deadline = time.monotonic() + _JOB_LIMIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    logs = [f.read_text() if f.exists() else "" for f in files]
    seen = []
    for r in range(world):
        path = out / f"{r}.json"
        seen.append(json.loads(path.read_text()) if path.exists() else {"log": logs[r][-3000:]})
    return codes, seen


@pytest.fixture(scope="module", params=["before", "between", "after", "offload"])
def two_ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[int | None], list[dict[str, Any]]]:
    scenario = str(request.param)
    codes, seen = _job(tmp_path_factory.mktemp(scenario), 2, scenario)
    return scenario, codes, seen


def test_a_failing_rank_fails_every_rank_with_one_typed_error_naming_it(
    two_ranks: tuple[str, list[int | None], list[dict[str, Any]]],
) -> None:
    scenario, codes, (rank0, rank1) = two_ranks
    assert codes == [0, 0], (rank0.get("log"), rank1.get("log"))
    # The failed rank raises its own error; every other rank the same typed one, naming it.
    assert rank1["failure"] == ["InjectedFault", _FAULT[scenario]]
    assert rank0["failure"] == [
        "TransportError",
        f"trainer rank 1 raised InjectedFault: {_FAULT[scenario]}",
    ]
    for rank in (rank0, rank1):
        assert rank["after_failure"] == [2, 1, True]


def test_after_a_byte_moved_no_worker_generates_until_a_sync_lands(
    two_ranks: tuple[str, list[int | None], list[dict[str, Any]]],
) -> None:
    scenario, _codes, (rank0, _rank1) = two_ranks
    engine = rank0["engine_after_failure"]
    if scenario == "before":
        # Rank 1 failed at its first tensor, before any bucket left any rank: the
        # engine keeps serving version 1, whole, on both workers.
        assert engine["weights_valid"] == [True, True]
        assert len(engine["generated"]) == 4
        return
    assert engine["weights_valid"] == [False, False]
    kind, message = engine["generate_error"]
    assert kind == "SyncError"
    assert "weights are not valid" in message


def test_the_next_sync_heals_every_worker_to_the_trainers_greedy_output(
    two_ranks: tuple[str, list[int | None], list[dict[str, Any]]],
) -> None:
    _scenario, _codes, (rank0, rank1) = two_ranks
    assert rank0["after_heal"] == rank1["after_heal"] == [2, 2, False]
    healed = rank0["engine_after_heal"]
    assert healed["weights_valid"] == [True, True]
    assert healed["generated"] == rank0["trainer_greedy"]


def test_a_rank_killed_mid_sync_names_it_to_every_survivor_who_exits_and_a_restart_heals(
    tmp_path: Path,
) -> None:
    codes, (rank0, rank1, _rank2) = _job(tmp_path / "kill", 3, "kill")
    # The survivors exit by themselves (no wait on the dead rank); the killed one by SIGKILL.
    assert codes == [0, 0, -signal.SIGKILL], (rank0.get("log"), rank1.get("log"))
    pid = None
    for rank in (rank0, rank1):
        kind, message = rank["failure"]
        assert kind == "TransportError"
        # Rank 2 is named on both; a survivor that already exited after the failure
        # may be named beside it (its process is gone too by the time this looks).
        assert "trainer rank 2 died (process " in message
        assert " during the trainer ranks' vote on tensor 4: " in message
        pid = pid or message.split("trainer rank 2 died (process ")[1].split(")")[0]
        assert f"trainer rank 2 died (process {pid})" in message
        assert "trainer rank 0 died" not in message or rank is rank1
        assert rank["after_failure"] == [2, 1, True]
    # Rank 0's and rank 1's workers loaded buckets of the failed version: none serves.
    assert rank0["engine_after_failure"]["weights_valid"] == [False, False, False]
    assert rank0["engine_after_failure"]["generate_error"][0] == "SyncError"

    # The job restarted: its syncs heal (every worker equals the trainer's greedy output).
    codes, seen = _job(tmp_path / "restart", 3, "heal")
    assert codes == [0, 0, 0], [s.get("log") for s in seen]
    assert [s["after_heal"] for s in seen] == [[2, 2, False]] * 3
    healed = seen[0]["engine_after_heal"]
    assert healed["weights_valid"] == [True, True, True]
    assert healed["generated"] == seen[0]["trainer_greedy"]
