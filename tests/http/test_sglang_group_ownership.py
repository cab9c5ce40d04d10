"""Who may form, and tear down, an SGLang server's weight-update group (C41).

A real test-server process (TP=1) and real trainer processes (``python -c``) forming
SGLang's group over gloo on loopback with ``SGLangCollectiveWeightSynchronizer``:

* a second trainer refused by the server ("group name has already been created") fails
  typed (``OwnershipError``) at once, its rendezvous cancelled, and never destroys the
  live trainer's group;
* a trainer restarted after a SIGKILLed one (whose record says it is dead) reclaims the
  dead one's group on its first try.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiosync import (
    OwnershipError,
    SGLangCollectiveWeightSynchronizer,
    SGLangHTTPBackend,
    TrainCluster,
)

from .conftest import REPO, TestServer, _serve

pytestmark = pytest.mark.slow

GROUP = "/init_weights_update_group"
DESTROY = "/destroy_weights_update_group"
# A guard only: a refused trainer exits in about a second; one whose rendezvous is left
# running waits for its 600 s collective limit and is killed here (TimeoutExpired).
EXIT_GUARD_S = 120.0

#: A trainer process: forms ``group`` with the server at ``url`` and syncs once, then
#: ``hold`` (prints "synced" and sleeps until killed) or exits printing the error of a
#: refused formation as "ERROR <type>: <message>" (rc 0 either way).
_TRAINER = """
import sys, anyio, httpx, torch
import aiosync
from aiosync.testing import StateDictSource

async def main(url, group, mode):
    raw = httpx.get(url + "/_aiosync/manifest", timeout=60).json()
    manifest = {name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in raw}
    backend = aiosync.SGLangHTTPBackend(url)
    sync = aiosync.SGLangCollectiveWeightSynchronizer(
        StateDictSource.random(manifest), backend,
        train_cluster=aiosync.TrainCluster(master_addr="127.0.0.1"),
        dist_backend="gloo", group_name=group, collective_timeout_s=600.0)
    try:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        print("synced", flush=True)
        if mode == "hold":
            await anyio.sleep(3600)
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    finally:
        await sync.shutdown()
        await backend.aclose()

anyio.run(main, *sys.argv[1:])
"""


@pytest.fixture(scope="module")
def group_server(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield from _serve(server_workdir, dense_config, "--weights-update-timeout-s", "30")


@pytest.fixture
def server(group_server: TestServer) -> Iterator[TestServer]:
    group_server.reset()
    yield group_server


def _trainer(url: str, group: str, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(
        [sys.executable, "-c", _TRAINER, url, group, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _sync(trainer: Any, backend: SGLangHTTPBackend, group: str) -> Any:
    return SGLangCollectiveWeightSynchronizer(
        trainer,
        backend,
        train_cluster=TrainCluster(master_addr="127.0.0.1"),
        dist_backend="gloo",
        group_name=group,
        collective_timeout_s=60.0,
    )


def _group_calls(server: TestServer) -> list[tuple[str, int, str]]:
    return [
        (e["path"], e["status"], e["group_name"])
        for e in server.log()
        if e["path"] in (GROUP, DESTROY)
    ]


async def test_a_second_trainer_is_refused_at_once_and_leaves_the_live_trainers_group(
    server: TestServer, make_trainer: Any, state_equal: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    group = f"c41-live-{uuid.uuid4().hex[:8]}"
    trainer = make_trainer(seed=110)
    async with SGLangHTTPBackend(server.url) as backend, _sync(trainer, backend, group) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        second = _trainer(server.url, group, "join")
        out, err = second.communicate(timeout=EXIT_GUARD_S)
        assert second.returncode == 0, err[-2000:]
        (line,) = [x for x in out.splitlines() if x.startswith("ERROR")]
        assert line.startswith("ERROR OwnershipError: ") and f"pid {os.getpid()}" in line
        assert "terminate called" not in err
        # The live trainer's group is untouched: no destroy, and its next sync lands.
        assert _group_calls(server) == [(GROUP, 200, group), (GROUP, 400, group)]
        trainer.step(seed=111)
        await sync.mark_stale()
        await sync.sync_weights()
        state_equal(server.state_dict(), trainer.expected())
    assert _group_calls(server)[-1] == (DESTROY, 200, group)


async def test_a_trainer_restarted_after_a_sigkilled_one_reclaims_its_group_on_the_first_try(
    server: TestServer, make_trainer: Any, state_equal: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    group = f"c41-dead-{uuid.uuid4().hex[:8]}"
    first = _trainer(server.url, group, "hold")
    try:
        assert first.stdout is not None
        assert first.stdout.readline().strip() == "synced"
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    trainer = make_trainer(seed=112)
    async with SGLangHTTPBackend(server.url) as backend, _sync(trainer, backend, group) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        state_equal(server.state_dict(), trainer.expected())
        # The dead trainer's group destroyed, then this one's formed: one try.
        assert _group_calls(server) == [
            (GROUP, 200, group),
            (DESTROY, 200, group),
            (GROUP, 200, group),
        ]


async def test_a_refused_trainer_without_a_record_of_the_holder_is_told_so(
    server: TestServer, make_trainer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A holder this host has no record of (another host's trainer) is never destroyed."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    group = f"c41-unknown-{uuid.uuid4().hex[:8]}"
    holder = make_trainer(seed=113)
    async with SGLangHTTPBackend(server.url) as backend, _sync(holder, backend, group) as sync:
        # As if the holder ran on another host: this host keeps no record of it.
        monkeypatch.setenv("AIOSYNC_GROUP_RECORDS", str(tmp_path))
        other = _sync(make_trainer(seed=114), backend, group)
        with pytest.raises(OwnershipError, match="no record of its holder on this host"):
            await other.init_communicator()
        await other.shutdown()
        monkeypatch.delenv("AIOSYNC_GROUP_RECORDS")
        await sync.mark_stale()
        await sync.sync_weights()
    assert [c[:2] for c in _group_calls(server)] == [(GROUP, 200), (GROUP, 400), (DESTROY, 200)]
