"""Inline syncs: a small refit to one worker from one trainer rank rides in the receive's
session (one round trip, no connection), bit-exact; a bigger plan streams over the socket;
a sync cancelled after the worker loaded it inline keeps the version and the engine refuses
to generate until the next sync lands."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import SyncError
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.proxy import EngineProxy

pytestmark = pytest.mark.asyncio(loop_scope="session")


class _StopAfterReceive(EngineProxy):
    """Forwards to the engine; once a worker's ``aiosync_ipc_receive`` returned (the
    inline refit loaded and committed there), sets ``received`` and hangs, so that the
    test cancels the sync at that point."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        super().__init__(engine)
        self.received = anyio.Event()

    async def replied(self, method: str, replies: list[Any]) -> list[Any]:
        if method == "aiosync_ipc_receive" and not self.received.is_set():
            assert replies[0]["ok"], replies
            self.received.set()
            await anyio.sleep_forever()
        return replies


async def test_a_small_sync_to_one_worker_rides_in_the_session(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=71)
    source = h.TrainerSource(trainer.model, [])
    async with IPCWeightSynchronizer(source, dense_engine, trace=True) as sync:
        await sync.init_communicator()
        assert sync.plan is not None and len(sync.plan.buckets) == 1
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await h.assert_engine_equals(dense_engine, trainer)
        # The cause: the worker never connected, so it never said hello.
        assert sync._sender is not None and sync._sender._known_idents == {}
        # What an inline sync reports is this sync's, as a streamed one's.
        (result,) = sync.last_worker_results
        assert (result["ok"], result["tensors"]) == (True, sync.plan.num_tensors)
        assert sync.last_trace is not None
        assert [row["seq"] for row in sync.last_trace["workers"][0]] == [0]


async def test_a_plan_of_more_buckets_than_buffers_streams_over_the_socket(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=72)
    source = h.TrainerSource(trainer.model, [])
    async with IPCWeightSynchronizer(source, dense_engine, bucket_bytes=16384) as sync:
        await sync.init_communicator()
        assert sync.plan is not None and len(sync.plan.buckets) > 2
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        await h.assert_engine_equals(dense_engine, trainer)
        assert sync._sender is not None and list(sync._sender._known_idents) == [0]


async def test_an_inline_sync_cancelled_after_the_worker_loaded_it_is_not_served(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=73)
    stopper = _StopAfterReceive(dense_engine)
    source = h.TrainerSource(trainer.model, [])
    async with IPCWeightSynchronizer(source, stopper) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sync.sync_weights)
            await stopper.received.wait()
            tg.cancel_scope.cancel()
        # The worker took every byte under the new version, but the trainer never
        # labelled it: the weights must not serve under the old label.
        assert (sync.weight_version, sync.is_stale) == (0, True)
        with pytest.raises(SyncError):
            await dense_engine.generate(h.PROMPTS, max_new_tokens=1)
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await h.assert_engine_equals(dense_engine, trainer)
