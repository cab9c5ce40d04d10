"""Elastic fleets: ``EngineFleet(on_engine_failure="quarantine")`` over three real embedded
engines, over IPC and over the collective. One whose worker is stopped (SIGSTOP) mid-sync
fails its probe (no answer within ``probe_timeout_s``) and is set aside, named, not the
healthy engine that waited for it. A default fleet names a member killed mid-sync and
refuses to generate at once; below ``min_engines`` the sync fails as without quarantine.

An engine killed mid-sync, set aside while the others commit, then revived and joining
with the next sync, and one killed while serving (the fleet's generate fails naming it,
the next sync sets it aside): the conformance kit's ``elastic`` cell, on every transport
that declares it (``aiosync.testing.conformance.check_elastic``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync import (
    EngineFleet,
    SyncError,
    TrainCluster,
    TransportError,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from tests._support.sources import HookedSource, hooked_trainer

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
VICTIM = "engine 1 of 3 (EmbeddedEngine)"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[list[EmbeddedEngine]]:
    started = [
        EmbeddedEngine(TINY_QWEN3, num_workers=1, seed=7, rpc_timeout_s=60) for _ in range(3)
    ]
    for engine in started:
        await engine.start()
    try:
        yield started
    finally:
        for engine in started:
            await engine.shutdown()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _holds(engines: list[EmbeddedEngine], trainer: HFModelRunner) -> list[bool]:
    want = trainer.hf_state_dict()
    out = []
    for engine in engines:
        (state,) = await engine.hf_state_dicts()
        out.append(all(torch.equal(state[n], t) for n, t in want.items()))
    return out


def _kill_at(source: HookedSource, engine: EmbeddedEngine, index: int) -> None:
    def kill(i: int) -> None:
        if i == index:
            source.on_tensor = lambda i: None
            os.kill(engine.pids[0], signal.SIGKILL)

    source.on_tensor = kill


async def _synced_then_killing(sync: Any, source: HookedSource, engine: EmbeddedEngine) -> None:
    """Version 1 synced; version 2 marked, its sync to kill ``engine``'s worker at the
    source's 6th tensor."""
    await sync.mark_stale()
    await sync.sync_weights()
    _kill_at(source, engine, index=5)
    await sync.mark_stale()


async def _drain(events: Any) -> list[tuple[VersionEventKind, int, str | None]]:
    """The events published so far (each buffered before sync_weights returned):
    ``(kind, version, engine)``."""
    out = []
    while True:
        with anyio.move_on_after(0.5):
            event = await events.__anext__()
            out.append((event.kind, event.version, event.engine))
            continue
        return out


def _options(transport: str, workers: int) -> dict[str, Any]:
    """The synchronizer's options for ``transport`` over a fleet of ``workers`` workers."""
    if transport == "ipc":
        return {"colocated": True, "device": "cpu", "rpc_timeout_s": 10.0}
    return {
        "colocated": False,
        "train_cluster": TrainCluster(master_port=_port()),
        "inference_world_size": workers,
        "collective_timeout_s": 10.0,
        "rpc_timeout_s": 30.0,
    }


def _quarantining(
    engines: list[EmbeddedEngine], seed: int, options: dict[str, Any], **fleet_options: Any
) -> tuple[HFModelRunner, HookedSource, EngineFleet, Any]:
    """A trainer (``seed``), its hooked source, ``engines`` behind a quarantining fleet
    of at least 2 (and ``fleet_options``), and the synchronizer (``options``)."""
    trainer, source = hooked_trainer(seed)
    fleet = EngineFleet(engines, on_engine_failure="quarantine", min_engines=2, **fleet_options)
    sync = create_weight_synchronizer(source, fleet, backend="embedded", **options)
    return trainer, source, fleet, sync


@pytest.mark.parametrize("transport", ["ipc", "collective"])
async def test_an_engine_hung_mid_sync_fails_its_probe_and_is_quarantined_named(
    engines: list[EmbeddedEngine], transport: str
) -> None:
    # Short limits: the stopped worker makes the sync wait for one of them.
    options = {**_options(transport, 3), "rpc_timeout_s": 4.0}
    if transport == "collective":
        options["collective_timeout_s"] = 4.0
    trainer, source, fleet, sync = _quarantining(engines, 65, options, probe_timeout_s=2.0)
    hung = engines[1].pids[0]

    def stop(i: int) -> None:
        if i == 5:
            source.on_tensor = lambda i: None
            os.kill(hung, signal.SIGSTOP)

    try:
        async with sync, sync.subscribe() as events:
            await sync.mark_stale()
            await sync.sync_weights()
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1.5)
            source.on_tensor = stop
            await sync.mark_stale()
            await sync.sync_weights()  # engine 1 does not answer its probe: set aside
            assert (sync.weight_version, sync.is_stale) == (2, False)
            # The hung engine is named, not a healthy one that waited for it.
            assert list(fleet.quarantined) == [VICTIM]
            assert "did not answer its probe within 2.0 s" in fleet.quarantined[VICTIM]
            assert fleet.serving == [engines[0], engines[2]]
            seen = await _drain(events)
            assert [e for k, _, e in seen if k is VersionEventKind.ENGINE_QUARANTINED] == [VICTIM]
            assert seen[-1][:2] == (VersionEventKind.COMMITTED, 2)
            assert await _holds([engines[0], engines[2]], trainer) == [True, True]
            await fleet.prepare_for_generation()
            expected = trainer.generate(PROMPTS, max_new_tokens=4)
            assert await fleet.generate(PROMPTS, max_new_tokens=4, timeout_s=5.0) == expected
    finally:
        # Never leave a stopped process behind; its engine gets a fresh worker.
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
            os.kill(hung, signal.SIGKILL)
        with anyio.fail_after(30):
            while not engines[1].processes[0].exitcode:
                await anyio.sleep(0.05)
        await engines[1].respawn_dead_workers()


async def test_a_default_fleet_names_a_member_killed_mid_sync_and_refuses_to_generate_at_once(
    engines: list[EmbeddedEngine],
) -> None:
    _trainer, source = hooked_trainer(63)
    fleet = EngineFleet(engines[:2])  # on_engine_failure="fail"
    sync = create_weight_synchronizer(
        source,
        fleet,
        backend="embedded",
        colocated=False,
        train_cluster=TrainCluster(master_port=_port()),
        inference_world_size=2,
        collective_timeout_s=10.0,
        rpc_timeout_s=30.0,
    )
    async with sync:
        await _synced_then_killing(sync, source, engines[1])
        with pytest.raises(TransportError) as failed:
            await sync.sync_weights()
        # The message itself names the engine and its dead worker (not gloo's
        # "Connection reset by peer" with the engine in a note).
        assert str(failed.value).startswith(
            "engine 1 of 2 (EmbeddedEngine): engine worker(s) [0] died"
        )
        assert (sync.weight_version, sync.is_stale) == (1, True)
        # At once, naming it: a 5 s limit would otherwise end in SyncTimeoutError.
        with pytest.raises(TransportError, match=r"engine 1 of 2 \(EmbeddedEngine\): .*died"):
            await fleet.generate(PROMPTS, max_new_tokens=2, timeout_s=5.0)
    assert await engines[1].respawn_dead_workers() == [0]


async def test_below_min_engines_the_sync_fails_and_nothing_is_set_aside(
    engines: list[EmbeddedEngine],
) -> None:
    trainer, source = hooked_trainer(62)
    fleet = EngineFleet(engines, on_engine_failure="quarantine", min_engines=3)
    sync = create_weight_synchronizer(
        source, fleet, colocated=True, backend="embedded", device="cpu", rpc_timeout_s=10.0
    )
    async with sync:
        await _synced_then_killing(sync, source, engines[2])
        with pytest.raises(SyncError) as failed:
            await sync.sync_weights()
        # The error says which engine failed the probe, whichever engine it names.
        assert (
            "failed the fleet's probe after it: engine 2 of 3 (EmbeddedEngine): "
            "TransportError: engine worker(s) [0] died"
        ) in "\n".join(failed.value.__notes__)
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert fleet.quarantined == {} and fleet.serving == engines
        assert await engines[2].respawn_dead_workers() == [0]
        await sync.init_communicator()
        await sync.sync_weights()
        assert await _holds(engines, trainer) == [True, True, True]


def test_the_fleet_options_are_checked() -> None:
    with pytest.raises(ValueError, match="on_engine_failure"):
        EngineFleet([object()], on_engine_failure="retry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_engines"):
        EngineFleet([object()], min_engines=0)
