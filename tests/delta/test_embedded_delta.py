"""Delta refits over IPC (colocated) and the collective broadcast into the embedded
engine's real workers; the plain delta sync and its healing are the conformance kit's
delta cell (``aiosync.testing.conformance``), on every transport that declares delta.

A bf16 trainer takes AdamW steps. A sync that fails half-way (a worker killed after
patches were written) makes the next one full; a worker that does not hold the patches'
base refuses them before any byte is written; staged collective deltas stage only the
patches; in an IPC fleet, the engine whose worker was respawned gets every tensor while
the other gets the patches, in the same sync.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync import (
    CollectiveWeightSynchronizer,
    EngineFleet,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import TransportError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.packing import PatchPlan, plan_patches
from tests._support.builders import non_colocated
from tests._support.delta import DeltaTrainer, committed, holds, patch_bytes, refused_without_base

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def _engine(num_workers: int) -> EmbeddedEngine:
    return EmbeddedEngine(
        TINY_QWEN3, num_workers=num_workers, dtype="bfloat16", sleep_level=2, seed=5,
        rpc_timeout_s=120,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with _engine(2) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def other_engine() -> AsyncIterator[EmbeddedEngine]:
    async with _engine(1) as engine:
        yield engine


def _ipc(trainer: DeltaTrainer, generation: Any, **options: Any) -> IPCWeightSynchronizer:
    return IPCWeightSynchronizer(
        DTensorRefitSource(trainer.model),
        generation,
        **{"bucket_bytes": 16 * 1024, "rpc_timeout_s": 30.0, "delta": True, **options},
    )


def _collective(
    trainer: DeltaTrainer, engine: EmbeddedEngine, **options: Any
) -> CollectiveWeightSynchronizer:
    return non_colocated(CollectiveWeightSynchronizer, trainer.model, engine, delta=True, **options)


async def _true() -> bool:
    return True


@dataclass(frozen=True)
class Transport:
    """What differs between the two transports in these tests: how a synchronizer is
    built, the module whose ``plan_patches`` makes its wire, when the kill lands (the
    workers have written patches), what the failure says, and the held-base check to skip."""

    build: Callable[..., Any]
    module: str
    kill_at: Callable[[int], int]
    died: str
    check: str
    skip_check: Callable[[Any], Any]
    reinit: bool
    kill_options: dict[str, float]


TRANSPORTS = {
    "ipc": Transport(
        build=_ipc,
        module="aiosync.transports.ipc.synchronizer",
        kill_at=lambda n: 3 * n // 4,
        # The engine fails the sync's call as soon as the worker dies, naming it (not the
        # survivor's wait for a bucket that never comes, nor the trainer's for acks).
        died=r"engine worker 1 died: process \d+ exited",
        check="_workers_holding_baseline",
        skip_check=lambda sync: _peers(sync),
        reinit=False,
        # Short: were the death noticed only by a wait running out, the test would fail
        # on SyncTimeoutError instead of hanging.
        kill_options={"rpc_timeout_s": 10.0},
    ),
    "collective": Transport(
        build=_collective,
        module="aiosync.transports.collective.synchronizer",
        kill_at=lambda n: 3,  # worker 0 has written patches: a mix of two versions
        # The dead worker named, not the survivor whose collective lost it.
        died=r"engine worker\(s\) \[1\] died \(worker 1: process \d+ exited with code -9\)",
        check="_workers_hold_baseline",
        skip_check=lambda sync: _true,
        reinit=True,
        kill_options={"sync_timeout_s": 60.0},
    ),
}


def _peers(sync: IPCWeightSynchronizer) -> Any:
    async def holders() -> list[int]:
        return list(sync.peers)

    return holders


def _received(sync: IPCWeightSynchronizer) -> list[tuple[bool, int]]:
    """Each IPC worker's ``(applied patches, bytes loaded)`` in the last sync."""
    return [(r["delta"], r["bytes"]) for r in sync.last_worker_results]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_worker_killed_mid_delta_is_followed_by_a_full_sync(
    engine: EmbeddedEngine, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = TRANSPORTS[kind]
    trainer = DeltaTrainer(seed=32, lr=1e-3)
    async with t.build(trainer, engine, **t.kill_options) as sync, sync.subscribe() as events:
        await committed(sync, events)
        victim = engine.pids[1]

        def killing(*args: Any) -> PatchPlan:
            wire = plan_patches(*args)

            def stream() -> Iterator[tuple[str, torch.Tensor]]:
                for i, item in enumerate(wire.tensors):
                    if i == t.kill_at(len(wire.tensors)):
                        os.kill(victim, signal.SIGKILL)
                    yield item

            return dataclasses.replace(wire, tensors=stream())  # type: ignore[arg-type]

        monkeypatch.setattr(f"{t.module}.plan_patches", killing)
        trainer.step()
        await sync.mark_stale()
        with pytest.raises(TransportError, match=t.died):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert sync.delta_baseline is not None and sync.delta_baseline.version is None
        monkeypatch.undo()
        assert await engine.respawn_dead_workers() == [1]
        await sync.init_communicator()
        full = trainer.full_bytes()
        assert await committed(sync, events) == (False, full)
        if kind == "ipc":
            assert _received(sync) == [(False, full), (False, full)]
        assert await holds(engine, trainer.state())
        trainer.step()
        assert (await committed(sync, events))[0] is True  # deltas again
        assert await holds(engine, trainer.state())


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_worker_without_the_base_refuses_the_delta_before_writing(
    engine: EmbeddedEngine, kind: str
) -> None:
    t = TRANSPORTS[kind]
    trainer = DeltaTrainer(seed=33, lr=1e-3)
    async with t.build(trainer, engine) as sync, sync.subscribe() as events:
        await committed(sync, events)
        await engine.finish_generation()  # level 2: the weights are discarded (zeros)
        discarded = await engine.hf_state_dicts()
        # A trainer that skipped the check (the workers' held versions) would send the
        # delta anyway: each worker refuses it, naming both versions.
        setattr(sync, t.check, t.skip_check(sync))
        await refused_without_base(sync, trainer, engine, discarded)
        delattr(sync, t.check)
        # The checked path: the failure (and the discard) make the next sync a full one.
        if t.reinit:
            await sync.init_communicator()
        assert await committed(sync, events) == (False, trainer.full_bytes())
        await engine.prepare_for_generation()
        assert await holds(engine, trainer.state())


async def test_staged_deltas_stage_only_the_patches_and_commit_bit_exact(
    engine: EmbeddedEngine,
) -> None:
    trainer = DeltaTrainer(seed=34, lr=1e-5)
    full = trainer.full_bytes()
    async with _collective(trainer, engine, overlap="staged") as sync, sync.subscribe() as events:
        assert await committed(sync, events) == (False, full)
        for _ in range(2):
            before = trainer.state()
            trainer.step()
            after = trainer.state()
            delta, nbytes = await committed(sync, events)
            assert delta and nbytes == patch_bytes(before, after)
            # Each worker staged the wire buckets only, and reports what it wrote.
            assert [r["nbytes"] for r in sync.last_worker_results] == [nbytes, nbytes]
            assert await holds(engine, after)
        await engine.prepare_for_generation()
        expected = trainer.runner.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected


async def _kill_idle_worker(engine: EmbeddedEngine) -> None:
    """SIGKILL worker 0 and wait until the engine counts it dead."""
    os.kill(engine.pids[0], signal.SIGKILL)
    with anyio.fail_after(10):
        while True:
            try:
                await engine.status()
            except TransportError:
                return
            await anyio.sleep(0.05)


async def test_a_respawned_engine_of_a_fleet_gets_every_tensor_while_the_other_gets_patches(
    engine: EmbeddedEngine, other_engine: EmbeddedEngine
) -> None:
    trainer = DeltaTrainer(seed=34, lr=1e-5)
    fleet = EngineFleet([engine, other_engine])
    full = trainer.full_bytes()
    async with _ipc(trainer, fleet) as sync, sync.subscribe() as events:
        assert await committed(sync, events) == (False, full)
        trainer.step()
        assert (await committed(sync, events))[0] is True
        # Engine 1's only worker dies while idle and comes back with the initial weights.
        await _kill_idle_worker(other_engine)
        assert await fleet.respawn_dead_workers() == [2]
        await sync.init_communicator()
        before = trainer.state()
        trainer.step()
        after = trainer.state()
        patches = patch_bytes(before, after)
        assert await committed(sync, events) == (True, patches + full)
        assert _received(sync) == [(True, patches), (True, patches), (False, full)]
        assert await holds(fleet, after)
        await fleet.prepare_for_generation()
        expected = trainer.runner.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        assert await fleet.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected
        # Every worker holds the baseline again: patches for all.
        before = trainer.state()
        trainer.step()
        patches = patch_bytes(before, trainer.state())
        assert await committed(sync, events) == (True, patches)
        assert _received(sync) == [(True, patches)] * 3
        assert await holds(fleet, trainer.state())
        # A dead member is named as the fleet names it.
        await _kill_idle_worker(other_engine)
        trainer.step()
        await sync.mark_stale()
        with pytest.raises(TransportError, match=r"^engine 1 of 2 \(EmbeddedEngine\): "):
            await sync.sync_weights()
        assert await fleet.respawn_dead_workers() == [2]


async def test_the_factory_builds_a_colocated_delta_synchronizer() -> None:
    source = DTensorRefitSource(HFModelRunner.from_config(TINY_QWEN3, seed=1).model)
    sync = create_weight_synchronizer(
        source, object(), colocated=True, backend="embedded", delta=True
    )
    assert isinstance(sync, IPCWeightSynchronizer) and sync.delta_baseline is not None
