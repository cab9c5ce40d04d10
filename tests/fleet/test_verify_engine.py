"""``verify_engine()``: every worker hashes the weights it computes with and the trainer
hashes the same parts of what its source yields, moving no weights. A sync leaves them
equal (the check passes, also per tensor-parallel slice); one element of a live weight
written afterwards is found, named with the worker; the next sync restores it bit for bit
(slime's check)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from aiosync import RefitVerificationError, create_weight_synchronizer
from aiosync.engines.embedded._worker import tensor_to_wire
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from tests._support.builders import factory_pick

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NAME = "model.layers.1.mlp.down_proj.weight"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(TINY_QWEN3, num_workers=2, seed=3) as engine:
        yield engine


async def test_a_live_weight_changed_after_a_sync_is_found_and_the_next_sync_heals_it(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=81)
    sync = create_weight_synchronizer(
        DTensorRefitSource(trainer.model), engine, colocated=True, backend="embedded"
    )
    async with sync:
        with pytest.raises(RefitVerificationError, match="differs from the trainer's"):
            await sync.verify_engine()  # the engine still holds its own seed's weights
        await sync.mark_stale()
        await sync.sync_weights()
        tensors = len(trainer.hf_state_dict())
        assert await sync.verify_engine() == {
            "workers": 2,
            "tensors": 2 * tensors,
            "checksummed": 0,
            "version": 1,
        }
        # One element of one live weight, written behind the transport's back.
        state = trainer.hf_state_dict()
        corrupted = state[NAME].clone()
        corrupted.view(-1)[17] += 1.0
        await engine.collective_rpc(
            "embedded_load_state_dict", ({NAME: tensor_to_wire(corrupted)},)
        )
        with pytest.raises(
            RefitVerificationError, match=rf"engine worker 0: {NAME} differs from the trainer's"
        ):
            await sync.verify_engine()
        await sync.mark_stale()
        await sync.sync_weights()
        assert (await sync.verify_engine())["version"] == 2


async def test_each_tensor_parallel_rank_is_checked_against_its_slice() -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=82)
    async with EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=2, seed=4) as engine:
        sync = factory_pick(
            DTensorRefitSource(trainer.model),
            engine,
            world_size=2,
        )
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()
            report = await sync.verify_engine()
            assert report["workers"] == 2 and report["version"] == 1
            # The trainer moves on without a sync: the engine no longer matches it.
            with torch.no_grad():
                trainer.model.model.norm.weight.mul_(2.0)
            with pytest.raises(RefitVerificationError, match=r"model\.norm\.weight differs"):
                await sync.verify_engine()
