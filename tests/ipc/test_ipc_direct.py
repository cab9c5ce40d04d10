"""Direct mode: a trainer whose parameters live in named shared memory
(``aiosync.refit.share_parameters``) is synced without packing — each worker copies from
the trainer's own memory — bit-exact across AdamW steps, falling back to packing for a
tensor that moved, and keeping the fault guarantees (a transit fault, a cancellation)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from aiosync import share_parameters
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import RefitVerificationError, SyncError
from aiosync.refit import DTensorRefitSource
from aiosync.transports._leftovers import SHM_DIR
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = pytest.mark.asyncio(loop_scope="session")

BUCKET_BYTES = 65536


def _direct_buckets(sync: IPCWeightSynchronizer) -> list[list[bool]]:
    """Per worker, per bucket received in the last sync: whether it came direct."""
    assert sync.last_trace is not None
    workers = sync.last_trace["workers"]
    return [[bool(row.get("direct")) for row in workers[r]] for r in sorted(workers)]


def _ours_in_shm() -> set[str]:
    pid = str(os.getpid())
    return {n for n in os.listdir(SHM_DIR) if n.startswith("aiosync") and f"-{pid}-" in n}


async def _holds_live(engine: EmbeddedEngine, model: torch.nn.Module) -> None:
    """Every worker holds the module's live weights, bit for bit (read through the
    module: ``HFModelRunner.hf_state_dict`` reads aliases taken before the tensors moved)."""
    expected = dict(DTensorRefitSource(model).iter_weights())
    for rank, state in enumerate(await engine.hf_state_dicts()):
        assert list(state) == list(expected), f"worker {rank} names differ"
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), f"worker {rank}: {name} differs"


async def _heals(sync: Any, engine: EmbeddedEngine, model: torch.nn.Module) -> None:
    """The next sync lands: every worker holds the module's live weights."""
    await sync.sync_weights()
    await _holds_live(engine, model)


@contextlib.contextmanager
def _shared_trainer(h: SimpleNamespace, config: Any, seed: int) -> Iterator[Any]:
    """A trainer of ``config`` (``seed``) under :func:`~aiosync.share_parameters`."""
    trainer = h.trainer_model(config, seed=seed)
    with share_parameters(trainer.model):
        yield trainer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    model(input_ids=x).logits.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


async def test_shared_parameters_sync_direct_bit_exact_across_adamw_steps(
    moe_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    before = _ours_in_shm()
    trainer = h.trainer_model(h.MOE, seed=71)
    shared = share_parameters(trainer.model)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    sync = h.ipc_sync(trainer, moe_engine, bucket_bytes=BUCKET_BYTES, trace=True)
    try:
        await sync.init_communicator()
        for step in range(3):
            if step:
                async with sync.policy_update():
                    _step(trainer.model, optimizer, seed=step)
            else:
                await sync.mark_stale()
            await sync.sync_weights()
            assert (sync.weight_version, sync.is_stale) == (step + 1, False)
            # Every bucket of every worker came straight from the trainer's arena.
            direct = _direct_buckets(sync)
            assert len(direct) == 2 and all(d and all(d) for d in direct), direct
            await _holds_live(moe_engine, trainer.model)
        await moe_engine.prepare_for_generation()
        expected = trainer.generate(h.PROMPTS, max_new_tokens=4)
        assert await moe_engine.generate(h.PROMPTS, max_new_tokens=4) == expected
    finally:
        await sync.shutdown()
        shared.close()
    assert _ours_in_shm() == before  # the arena's name and the buckets are gone


async def test_a_tensor_that_moved_is_packed_and_the_rest_go_direct(
    moe_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    with _shared_trainer(h, h.MOE, 72) as trainer:
        sync = h.ipc_sync(trainer, moe_engine, bucket_bytes=BUCKET_BYTES, trace=True)
        async with sync:
            assert sync.plan is not None
            moved = "model.embed_tokens.weight"
            (where,) = [b.index for b in sync.plan.buckets if moved in {x.name for x in b.slots}]
            param = trainer.model.get_parameter(moved)
            with torch.no_grad():
                param.data = param.data.clone().mul_(2.0)  # re-homed into private memory
            await sync.mark_stale()
            await sync.sync_weights()
            for per_worker in _direct_buckets(sync):
                assert per_worker == [i != where for i in range(len(sync.plan.buckets))]
            await _holds_live(moe_engine, trainer.model)
            # With direct off every bucket is packed, bit-exact all the same.
            sync.direct = False
            await sync.mark_stale()
            await sync.sync_weights()
            assert _direct_buckets(sync) == [[False] * len(sync.plan.buckets)] * 2
            await _holds_live(moe_engine, trainer.model)


async def test_a_transit_fault_in_direct_mode_fails_typed_and_leaves_the_trainer_intact(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    with _shared_trainer(h, h.DENSE_TIED, 73) as trainer:
        sync = h.ipc_sync(trainer, dense_engine, bucket_bytes=BUCKET_BYTES)
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()
            held = {n: t.clone() for n, t in DTensorRefitSource(trainer.model).iter_weights()}
            assert sync.plan is not None
            first = sync.plan.buckets[1].slots[0].name
            await dense_engine.collective_rpc("aiosync_test_arm_transit_fault", args=(1, 0))
            await sync.mark_stale()
            with pytest.raises(RefitVerificationError, match=rf"bucket 1 \('{first}'"):
                await sync.sync_weights()
            assert (sync.weight_version, sync.is_stale) == (1, True)
            with pytest.raises(SyncError):
                await dense_engine.generate(h.PROMPTS, max_new_tokens=1)
            # The flip landed in the worker's private copy, not in the trainer's memory.
            now = dict(DTensorRefitSource(trainer.model).iter_weights())
            assert all(torch.equal(now[n], t) for n, t in held.items())
            await _heals(sync, dense_engine, trainer.model)


async def test_a_direct_sync_cancelled_mid_way_keeps_the_version_and_heals(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    with _shared_trainer(h, h.DENSE_TIED, 74) as trainer:
        scope = anyio.CancelScope()

        def cancel_at(i: int) -> None:
            if i == 5 and source.on_tensor is not None:
                source.on_tensor = None
                anyio.from_thread.run_sync(scope.cancel)

        source: Any = h.TrainerSource(trainer.model, [])
        sync = IPCWeightSynchronizer(source, dense_engine, bucket_bytes=BUCKET_BYTES)
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()
            v1 = {n: t.clone() for n, t in DTensorRefitSource(trainer.model).iter_weights()}
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(0.5)
            await sync.mark_stale()
            source.on_tensor = cancel_at
            with scope:
                await sync.sync_weights()
            assert scope.cancelled_caught
            assert (sync.weight_version, sync.is_stale) == (1, True)
            # Cancelled before the worker's session committed: the engine refuses to
            # generate (its receive began) or still serves version 1, whole.
            try:
                await dense_engine.generate(h.PROMPTS, max_new_tokens=1)
            except SyncError:
                pass
            else:
                for rank, state in enumerate(await dense_engine.hf_state_dicts()):
                    for name, tensor in v1.items():
                        assert torch.equal(state[name], tensor), f"worker {rank}: {name}"
            await _heals(sync, dense_engine, trainer.model)


async def test_a_plan_of_more_buckets_than_buffers_rides_in_the_session_when_all_go_direct(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    with _shared_trainer(h, h.DENSE_TIED, 75) as trainer:
        source = h.TrainerSource(trainer.model, [])
        async with IPCWeightSynchronizer(source, dense_engine, bucket_bytes=16384) as sync:
            assert sync.plan is not None and len(sync.plan.buckets) > 2  # > the 2 buffers
            await sync.mark_stale()
            await sync.sync_weights()
            assert sync.weight_version == 1
            await _holds_live(dense_engine, trainer.model)
            # The cause: only refs travel, inside the receive's session; the worker never
            # connected, so it never said hello.
            assert sync._sender is not None and sync._sender._known_idents == {}


async def test_a_bucket_that_does_not_go_direct_streams_the_plan_over_the_socket(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    with _shared_trainer(h, h.DENSE_TIED, 76) as trainer:
        source = h.TrainerSource(trainer.model, [])
        sync = IPCWeightSynchronizer(source, dense_engine, bucket_bytes=16384, trace=True)
        async with sync:
            assert sync.plan is not None
            # A tensor of a middle bucket leaves the arena: the buckets read before it
            # went direct, it and the rest stream (its bucket packed).
            where = len(sync.plan.buckets) // 2
            moved = sync.plan.buckets[where].slots[0].name
            param = trainer.model.get_parameter(moved)
            with torch.no_grad():
                param.data = param.data.clone().mul_(2.0)
            await sync.mark_stale()
            await sync.sync_weights()
            assert _direct_buckets(sync) == [[i != where for i in range(len(sync.plan.buckets))]]
            await _holds_live(dense_engine, trainer.model)
            assert sync._sender is not None and list(sync._sender._known_idents) == [0]
