"""Delta refits over the collective broadcast into the embedded engine's real workers.

A bf16 trainer takes AdamW steps; after the first (full) sync each sync moves only the
patches of the elements whose bits changed, in the smallest encoding per tensor, and
every worker ends bit-identical to the trainer. A sync that fails half-way, a worker
that does not hold the patches' base, or discarded weights make the next sync full.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from aiosync import CollectiveWeightSynchronizer, TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import RefitMismatchError, TransportError
from aiosync.refit import DTensorRefitSource
from tests._support.delta import (
    DeltaTrainer,
    committed,
    holds,
    patch_bytes,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(
        TINY_QWEN3, num_workers=2, dtype="bfloat16", sleep_level=2, seed=5, rpc_timeout_s=120
    ) as engine:
        yield engine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sync(
    trainer: DeltaTrainer, engine: EmbeddedEngine, **options: Any
) -> CollectiveWeightSynchronizer:
    return CollectiveWeightSynchronizer(
        DTensorRefitSource(trainer.model),
        engine,
        train_cluster=TrainCluster(master_port=_port()),
        inference_world_size=engine.world_size,
        bucket_bytes=16 * 1024,
        collective_timeout_s=30.0,
        delta=True,
        **options,
    )


async def test_a_worker_killed_mid_delta_is_followed_by_a_full_sync(
    engine: EmbeddedEngine,
) -> None:
    trainer = DeltaTrainer(seed=32, lr=1e-3)
    async with _sync(trainer, engine, sync_timeout_s=60.0) as sync, sync.subscribe() as events:
        await committed(sync, events)
        victim = engine.pids[1]
        real = sync._diff

        def killing(*args: Any) -> Any:
            plan, wires, spec = real(*args)

            def stream() -> Iterator[tuple[str, torch.Tensor]]:
                for i, item in enumerate(wires):
                    if i == 3:  # worker 0 has written patches: a mix of two versions
                        os.kill(victim, signal.SIGKILL)
                    yield item

            return plan, stream(), spec

        sync._diff = killing  # type: ignore[method-assign]
        trainer.step()
        await sync.mark_stale()
        with pytest.raises(TransportError):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert sync.delta_baseline is not None and sync.delta_baseline.version is None
        sync._diff = real  # type: ignore[method-assign]
        assert await engine.respawn_dead_workers() == [1]
        await sync.init_communicator()
        delta, nbytes = await committed(sync, events)
        full = sum(t.numel() * t.element_size() for t in trainer.state().values())
        assert (delta, nbytes) == (False, full)
        assert await holds(engine, trainer.state())
        trainer.step()
        assert (await committed(sync, events))[0] is True  # deltas again
        assert await holds(engine, trainer.state())


async def test_a_worker_without_the_base_refuses_the_delta_before_writing(
    engine: EmbeddedEngine,
) -> None:
    trainer = DeltaTrainer(seed=33, lr=1e-3)
    async with _sync(trainer, engine) as sync, sync.subscribe() as events:
        await committed(sync, events)
        await engine.finish_generation()  # level 2: the weights are discarded (zeros)
        discarded = await engine.hf_state_dicts()
        # A trainer that skipped the check (the workers' held versions) would send the
        # delta anyway: each worker refuses it, naming both versions.
        sync._workers_hold_baseline = _always  # type: ignore[method-assign]
        trainer.step()
        await sync.mark_stale()
        with pytest.raises(RefitMismatchError, match="holds version None, the delta patches"):
            await sync.sync_weights()
        after = await engine.hf_state_dicts()
        pairs = zip(discarded, after, strict=True)
        assert all(torch.equal(a[n], b[n]) for a, b in pairs for n in a)
        del sync._workers_hold_baseline
        # The checked path: the discard makes the next sync a full one.
        await sync.init_communicator()
        full = sum(t.numel() * t.element_size() for t in trainer.state().values())
        assert await committed(sync, events) == (False, full)
        await engine.prepare_for_generation()
        assert await holds(engine, trainer.state())


async def _always() -> bool:
    return True


async def test_staged_deltas_stage_only_the_patches_and_commit_bit_exact(
    engine: EmbeddedEngine,
) -> None:
    trainer = DeltaTrainer(seed=34, lr=1e-5)
    full = trainer.full_bytes()
    async with _sync(trainer, engine, overlap="staged") as sync, sync.subscribe() as events:
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
