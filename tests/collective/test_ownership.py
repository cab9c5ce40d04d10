"""A sync group on the engine's workers belongs to the synchronizer that formed it (issue 15).

A group whose owner died without a word (its store gone, as after a SIGKILL) is taken
over. While the owner lives, a second synchronizer is refused (``OwnershipError``, at
once, before any rendezvous) and the owner keeps syncing; shut down, it is taken over:
the conformance kit's ``second_owner`` cell (``aiosync.testing.conformance``).
"""

from __future__ import annotations

import gc

import pytest
import torch
from collective_harness import QWEN3

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.synchronizer import WeightSynchronizer
from tests._support.builders import factory_pick
from tests._support.steps import first_sync

pytestmark = pytest.mark.slow


def _sync(trainer: HFModelRunner, engine: EmbeddedEngine) -> WeightSynchronizer:
    return factory_pick(
        DTensorRefitSource(trainer.model),
        engine,
        world_size=1,
        collective_timeout_s=60.0,
        rpc_timeout_s=30.0,
    )


async def _equals(engine: EmbeddedEngine, trainer: HFModelRunner) -> bool:
    expected = dict(DTensorRefitSource(trainer.model).iter_weights())
    (state,) = await engine.hf_state_dicts()
    return list(state) == list(expected) and all(
        torch.equal(state[n], t) for n, t in expected.items()
    )


async def test_a_group_whose_owner_died_without_a_word_is_taken_over() -> None:
    trainer_a = HFModelRunner.from_config(dict(QWEN3), seed=303)
    trainer_b = HFModelRunner.from_config(dict(QWEN3), seed=304)
    async with EmbeddedEngine(dict(QWEN3), num_workers=1, seed=7) as engine:
        sync_a = _sync(trainer_a, engine)
        await first_sync(sync_a)
        # What a SIGKILL leaves: the worker still holds A's group, A's store is gone.
        group, store = sync_a._group, sync_a._store  # type: ignore[attr-defined]
        assert group is not None and store is not None
        group.destroy()
        sync_a._group = sync_a._store = None  # type: ignore[attr-defined]
        del group, store, sync_a
        gc.collect()

        sync_b = _sync(trainer_b, engine)
        await first_sync(sync_b)
        assert (sync_b.weight_version, sync_b.is_stale) == (1, False)
        assert await _equals(engine, trainer_b)
        await sync_b.shutdown()
