"""Shared test configuration: every test here runs on CPU with real processes and sockets."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import start_script
from tests._support.net import free_port

# Tests never download: models are built from small configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_REPO = Path(__file__).resolve().parents[1]
#: How long the other ranks may take to end once one rank failed, seconds.
_GRACE_S = 30.0


#: Folders whose tests share one session resource, so one test process runs them
#: all under ``make test``'s ``-n N``: the Ray tests and their Ray cluster.
_ONE_PROCESS_FOLDERS = ("tests/ray/",)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` hands whole test modules to the test processes (their module
    fixtures, engines, servers and worker pools, start once), and each folder of
    :data:`_ONE_PROCESS_FOLDERS` to one process."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return next((f for f in _ONE_PROCESS_FOLDERS if module.startswith(f)), module)

    return ByModule(config, log)


#: What :func:`spawn_ranks` returns: ``run(script, world_size, extra)``.
SpawnRanks = Callable[[Path, int, Callable[[int], Sequence[str]]], None]


@pytest.fixture(scope="session")
def spawn_ranks() -> SpawnRanks:
    """Run ``python script RANK WORLD_SIZE PORT *extra(RANK)`` for every rank at once
    (real processes of a torch.distributed group meeting at 127.0.0.1:PORT, a free
    port; :func:`tests._support.launch.start_script`) and wait; fail with the log of
    any rank that did not exit 0."""

    def run(script: Path, world_size: int, extra: Callable[[int], Sequence[str]]) -> None:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]),
        }
        with tempfile.TemporaryDirectory(prefix="aiosync-ranks-") as folder:
            logs = [Path(folder) / f"rank{r}.log" for r in range(world_size)]
            # Forked from the forkserver that preloaded torch and aiosync (each rank a
            # process of its own), not a fresh interpreter importing them again.
            procs = [
                start_script(script, [str(r), str(world_size), str(port), *extra(r)], logs[r], env)
                for r in range(world_size)
            ]
            try:
                # Once one rank failed, the others get a grace period to end, instead of
                # each waiting out its own timeouts (the run's limit is 600 s).
                deadline = time.monotonic() + 600
                failed_at: float | None = None
                while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                    if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                        failed_at = time.monotonic()
                    if failed_at is not None and time.monotonic() > failed_at + _GRACE_S:
                        break
                    time.sleep(0.2)
            finally:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                    p.join()
                texts = [log.read_text() if log.exists() else "" for log in logs]
        for r, p in enumerate(procs):
            assert p.exitcode == 0, f"rank {r} failed (exit code {p.exitcode}):\n{texts[r][-4000:]}"

    return run
