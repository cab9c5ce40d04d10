"""Delta refits on the shard-aware plan into the embedded engine's real TP=2 workers.

A bf16 trainer takes AdamW steps; after the first (full) sync each sync moves, per
transfer of the plan (one box of one tensor to one worker), only the elements whose bits
changed (full-tensor int32 indices + values, or the box dense when smaller), and every
worker ends holding exactly its slice of the trainer's tensors. A worker that does not
hold the patches' base refuses them before writing; a failed sync makes the next one
full. The 2-rank FSDP2 trainer is in ``test_sharded_ranks.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
import pytest_asyncio
import torch

from aiosync import TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import TransportError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded import ShardedWeightSynchronizer
from tests._support.builders import factory_pick, non_colocated
from tests._support.delta import DeltaTrainer, bits, committed, refused_without_base
from tests._support.fsdp2 import failing_shard_read

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(
        TINY_QWEN3,
        num_workers=1,
        tensor_parallel_size=2,
        dtype="bfloat16",
        sleep_level=2,
        seed=5,
        rpc_timeout_s=120,
    ) as engine:
        yield engine


def _sync(
    trainer: DeltaTrainer, engine: EmbeddedEngine, **options: Any
) -> ShardedWeightSynchronizer:
    return non_colocated(ShardedWeightSynchronizer, trainer.model, engine, delta=True, **options)


async def _holds_slices(engine: EmbeddedEngine, full: Mapping[str, torch.Tensor]) -> bool:
    """Whether every worker holds exactly its part of ``full``, bit for bit."""
    layouts = await engine.weight_layouts()
    for layout, state in zip(layouts, await engine.hf_state_dicts(), strict=True):
        for name, tensor in full.items():
            part = layout[name]
            want = tensor.narrow(part.dim, part.start, part.length) if part.shape else tensor
            if not torch.equal(bits(state[name].contiguous()), bits(want.contiguous())):
                return False
    return True


async def test_a_worker_without_the_base_refuses_the_delta_before_writing(
    engine: EmbeddedEngine,
) -> None:
    trainer = DeltaTrainer(seed=42, lr=1e-3)
    async with _sync(trainer, engine) as sync, sync.subscribe() as events:
        await committed(sync, events)
        await engine.finish_generation()  # level 2: the weights are discarded (zeros)
        discarded = await engine.hf_state_dicts()
        # A trainer that skipped the check of the workers' held versions would send the
        # delta anyway: each worker refuses it, naming both versions, and writes nothing.
        sync._delta_base = _version_one  # type: ignore[method-assign]
        await refused_without_base(sync, trainer, engine, discarded)
        assert sync.delta_baseline is not None and sync.delta_baseline.version is None
        del sync._delta_base
        # The checked path: the discard makes the next sync a full one.
        assert await committed(sync, events) == (False, sync.transfer_plan.total_nbytes)
        await engine.prepare_for_generation()
        assert await _holds_slices(engine, trainer.state())


async def _version_one() -> int:
    return 1


async def test_a_failed_delta_is_followed_by_a_full_sync_then_deltas_again(
    engine: EmbeddedEngine,
) -> None:
    trainer = DeltaTrainer(seed=43, lr=1e-3)
    async with _sync(trainer, engine) as sync, sync.subscribe() as events:
        await committed(sync, events)
        trainer.step()
        with failing_shard_read(sync, rank=0, fails=0, at=5):  # the trainer's one rank
            await sync.mark_stale()
            with pytest.raises(TransportError, match="rank 0 could not read its shard"):
                await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert sync.delta_baseline is not None and sync.delta_baseline.version is None
        assert await committed(sync, events) == (False, sync.transfer_plan.total_nbytes)
        assert await _holds_slices(engine, trainer.state())
        trainer.step()
        assert (await committed(sync, events))[0] is True
        assert await _holds_slices(engine, trainer.state())


async def test_the_factory_passes_delta_to_the_shard_aware_path(engine: EmbeddedEngine) -> None:
    source = DTensorRefitSource(HFModelRunner.from_config(TINY_QWEN3, seed=1).model)
    sync = factory_pick(
        source,
        engine,
        delta=True,
    )
    assert type(sync) is ShardedWeightSynchronizer and sync.delta_baseline is not None


async def test_delta_needs_the_torch_data_plane() -> None:
    source = DTensorRefitSource(HFModelRunner.from_config(TINY_QWEN3, seed=1).model)
    with pytest.raises(ValueError, match="needs data_plane='torch'"):
        ShardedWeightSynchronizer(
            source, None, train_cluster=TrainCluster(), inference_world_size=1,
            dist_backend="gloo", data_plane="mooncake", delta=True,
        )  # fmt: skip
