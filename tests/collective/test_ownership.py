"""A sync group on the engine's workers belongs to the synchronizer that formed it (issue 15).

A second synchronizer may not destroy or join it while its owner is alive
(``OwnershipError``, at once, before any rendezvous), the owner keeps syncing
undisturbed, and once the owner is gone — shut down, or its store closed as
when its process dies — the group is taken over.
"""

from __future__ import annotations

import gc

import pytest
import torch
from collective_harness import QWEN3

from aiosync import OwnershipError
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


async def test_a_live_owners_group_is_never_destroyed_by_another_synchronizer() -> None:
    trainer_a = HFModelRunner.from_config(dict(QWEN3), seed=301)
    trainer_b = HFModelRunner.from_config(dict(QWEN3), seed=302)
    async with EmbeddedEngine(dict(QWEN3), num_workers=1, seed=7) as engine:
        sync_a, sync_b = _sync(trainer_a, engine), _sync(trainer_b, engine)
        await first_sync(sync_a)

        with pytest.raises(OwnershipError, match="another synchronizer"):
            await sync_b.init_communicator()
        # A's group survived B's attempt: A keeps syncing.
        with torch.no_grad():
            for p in trainer_a.model.parameters():
                p.mul_(1.5)
        await sync_a.mark_stale()
        await sync_a.sync_weights()
        assert (sync_a.weight_version, sync_a.is_stale) == (2, False)
        assert await _equals(engine, trainer_a)

        # Owner gone (its store closed, as when its process dies, without telling
        # the workers): B takes the group over and syncs.
        await sync_a.shutdown()
        await first_sync(sync_b)
        assert (sync_b.weight_version, sync_b.is_stale) == (1, False)
        assert await _equals(engine, trainer_b)
        await sync_b.shutdown()


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
