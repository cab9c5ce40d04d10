"""Engine fleets: one synchronizer, several engines (real embedded-engine processes).

Engine A has two workers, engine B one; the fleet numbers them 0, 1 (A) and 2 (B).
One sync updates all three bit for bit, over IPC and over the collective; a
failure in one engine fails the sync for all, names the engine, and leaves every
engine refusing to generate until a sync lands.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from aiosync import (
    EngineFleet,
    RefitMismatchError,
    SyncError,
    TransportError,
    create_weight_synchronizer,
    refit_if_stale,
)
from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_TIED
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.builders import factory_pick
from tests._support.sources import hooked_trainer

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

ENGINE_SEED = 3
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10], [11, 12]]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine_a() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(TINY_QWEN3, num_workers=2, seed=ENGINE_SEED) as engine:
        yield engine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine_b() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(TINY_QWEN3, num_workers=1, seed=ENGINE_SEED) as engine:
        yield engine


async def _assert_all_equal(fleet: EngineFleet, trainer: HFModelRunner) -> None:
    expected = trainer.hf_state_dict()
    states = await fleet.hf_state_dicts()
    assert len(states) == 3
    for rank, state in enumerate(states):
        assert list(state) == list(expected), f"worker {rank} names differ"
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), f"worker {rank}: {name} differs"


async def test_one_ipc_sync_updates_every_engine_and_ranks_are_global(
    engine_a: EmbeddedEngine, engine_b: EmbeddedEngine
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=41)
    sync = create_weight_synchronizer(
        DTensorRefitSource(trainer.model), [engine_a, engine_b], colocated=True, backend="embedded"
    )
    fleet = sync.generation
    assert isinstance(fleet, EngineFleet) and fleet.engines == [engine_a, engine_b]
    async with sync:  # initializes the communicator
        assert [fleet.locate(r) for r in range(3)] == [(0, 0), (0, 1), (1, 0)]
        assert await fleet.collective_rpc("aiosync_worker_rank") == [0, 1, 2]
        await sync.mark_stale()
        assert await refit_if_stale(sync, fleet) is True
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert (engine_a.weight_version, engine_b.weight_version) == (1, 1)
        await _assert_all_equal(fleet, trainer)
        # Prompts are split over the engines and come back in order.
        expected = trainer.generate(PROMPTS, max_new_tokens=4)
        assert await fleet.generate(PROMPTS, max_new_tokens=4) == expected


async def test_one_collective_sync_updates_every_engine(
    engine_a: EmbeddedEngine, engine_b: EmbeddedEngine
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=42)
    sync = factory_pick(
        DTensorRefitSource(trainer.model),
        [engine_a, engine_b],
        world_size=3,
        collective_timeout_s=60.0,
    )
    async with sync:  # initializes the communicator
        await sync.mark_stale()
        await sync.sync_weights()
        await sync.generation.prepare_for_generation()
        assert sync.weight_version == 1
        await _assert_all_equal(sync.generation, trainer)


async def test_a_mismatched_engine_fails_init_naming_it_before_any_byte_moves(
    engine_a: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=43)
    before = await engine_a.hf_state_dicts()
    # The tied engine's checkpoint has no lm_head.weight: its manifest differs.
    async with EmbeddedEngine(TINY_QWEN3_TIED, num_workers=1, seed=ENGINE_SEED) as tied:
        sync = create_weight_synchronizer(
            DTensorRefitSource(trainer.model), [engine_a, tied], colocated=True, backend="embedded"
        )
        with pytest.raises(RefitMismatchError, match=r"engine 1 of 2 \(EmbeddedEngine\)"):
            async with sync:
                pytest.fail("the block must not run")
        assert (sync.weight_version, sync.policy_version) == (0, 0)
    after = await engine_a.hf_state_dicts()
    for old, new in zip(before, after, strict=True):
        assert all(torch.equal(old[n], new[n]) for n in old)


async def test_an_engine_killed_mid_sync_fails_it_for_all_and_both_refuse_until_a_sync_lands(
    engine_a: EmbeddedEngine, engine_b: EmbeddedEngine
) -> None:
    trainer, source = hooked_trainer(44)
    sync = create_weight_synchronizer(
        source, [engine_a, engine_b], colocated=True, backend="embedded"
    )
    fleet = sync.generation
    async with sync:  # initializes the communicator
        await sync.mark_stale()
        await refit_if_stale(sync, fleet)
        assert sync.weight_version == 1

        victim = engine_b.pids[0]

        def kill(i: int) -> None:
            if i == 6:
                os.kill(victim, signal.SIGKILL)

        source.on_tensor = kill
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.5)
        await sync.mark_stale()
        with pytest.raises(TransportError, match=r"engine 1 of 2 \(EmbeddedEngine\): .*died"):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert engine_a.weight_version == 1  # the engine does not report the failed version
        # Engine A took part of version 2: it refuses; engine B is dead.
        assert [s["weights_valid"] for s in await engine_a.status()] == [False, False]
        with pytest.raises(SyncError, match="worker 0: weights are not valid"):
            await engine_a.generate(PROMPTS, max_new_tokens=2)
        with pytest.raises(SyncError, match=r"engine [01] of 2 \(EmbeddedEngine\)"):
            await fleet.generate(PROMPTS, max_new_tokens=2)

        source.on_tensor = lambda i: None
        assert await fleet.respawn_dead_workers() == [2]
        await sync.init_communicator()  # the new worker learns the plan and its rank
        assert await refit_if_stale(sync, fleet) is True
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert (engine_a.weight_version, engine_b.weight_version) == (2, 2)
        await _assert_all_equal(fleet, trainer)
        assert await fleet.collective_rpc("aiosync_worker_rank") == [0, 1, 2]


async def _kill_idle_worker(engine: EmbeddedEngine) -> None:
    """SIGKILL ``engine``'s only worker and wait until the engine noticed."""
    os.kill(engine.pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            await engine.status()
        except TransportError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not notice its worker's death")


RPC_TIMEOUT_S = 10.0


@pytest.mark.parametrize("respawn_by", ["fleet", "member engine"])
@pytest.mark.parametrize("failed_sync_first", [False, True], ids=["idle", "after a failed sync"])
async def test_a_worker_killed_while_idle_heals_on_the_first_sync_after_respawn_and_init(
    engine_a: EmbeddedEngine, engine_b: EmbeddedEngine, respawn_by: str, failed_sync_first: bool
) -> None:
    """Respawning through the fleet or through the member engine itself gives the new
    worker its global rank (no two workers claim one), and a sync that failed on
    the dead worker leaves no receive running on the others: the first sync after
    ``init_communicator()`` lands, bit-exact, in far less than the RPC timeout."""
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=45)
    fleet = EngineFleet([engine_a, engine_b])
    sync = IPCWeightSynchronizer(
        DTensorRefitSource(trainer.model),
        fleet,
        rpc_timeout_s=RPC_TIMEOUT_S,
        sync_timeout_s=2 * RPC_TIMEOUT_S,
    )
    async with sync:  # initializes the communicator
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1

        await _kill_idle_worker(engine_b)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.5)
        await sync.mark_stale()
        if failed_sync_first:
            with pytest.raises(TransportError, match=r"engine 1 of 2 \(EmbeddedEngine\): .*dead"):
                await sync.sync_weights()
            assert (sync.weight_version, sync.is_stale) == (1, True)

        if respawn_by == "fleet":
            assert await fleet.respawn_dead_workers() == [2]
        else:
            assert await engine_b.respawn_dead_workers() == [0]
        assert sync.is_stale  # the new worker holds the initial weights
        started = time.monotonic()
        await sync.init_communicator()
        await sync.sync_weights()
        assert time.monotonic() - started < RPC_TIMEOUT_S / 2
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert (engine_a.weight_version, engine_b.weight_version) == (2, 2)
        assert await fleet.collective_rpc("aiosync_worker_rank") == [0, 1, 2]
        await _assert_all_equal(fleet, trainer)


async def test_a_fleet_refuses_no_engine_and_duplicates() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        EngineFleet([])
    engine = object()
    with pytest.raises(ValueError, match="twice"):
        EngineFleet([engine, engine])
