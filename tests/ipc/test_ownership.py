"""Two IPC synchronizers on one engine: neither disturbs the other's refit (issue 15).

A worker's receive belongs to the synchronizer that started it (its owner
token): a second synchronizer's session is refused with ``OwnershipError``
while the first one's refit runs, the first one's refit lands untouched, and
the second one syncs normally once the worker is free.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import anyio
import pytest

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import OwnershipError
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = pytest.mark.asyncio(loop_scope="session")

BUCKET_BYTES = 16384


async def test_a_second_synchronizer_is_refused_while_the_first_refits_and_syncs_after(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    streaming = threading.Event()
    refused = threading.Event()

    def hold_after_first_buckets(i: int) -> None:
        # A's refit is on the engine (buckets landed) while B tries its own.
        if i == 3:
            streaming.set()
            assert refused.wait(60), "B's sync never came back"

    trainer_a = h.trainer_model(h.DENSE_TIED, seed=31)
    trainer_b = h.trainer_model(h.DENSE_TIED, seed=32)
    sync_a = IPCWeightSynchronizer(
        h.TrainerSource(trainer_a.model, [], on_tensor=hold_after_first_buckets),
        dense_engine,
        bucket_bytes=BUCKET_BYTES,
        rpc_timeout_s=60,
    )
    sync_b = IPCWeightSynchronizer(
        h.TrainerSource(trainer_b.model, []),
        dense_engine,
        bucket_bytes=BUCKET_BYTES,
        rpc_timeout_s=60,
    )
    async with sync_a, sync_b:
        await sync_a.init_communicator()
        await sync_b.init_communicator()
        await sync_a.mark_stale()
        await sync_b.mark_stale()
        errors: list[BaseException] = []

        async def sync_b_while_a_streams() -> None:
            await anyio.to_thread.run_sync(streaming.wait, 60)
            try:
                await sync_b.sync_weights()
            except OwnershipError as exc:
                errors.append(exc)
            finally:
                refused.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(sync_b_while_a_streams)
            await sync_a.sync_weights()

        assert len(errors) == 1, "B's sync must be refused while A's refit runs"
        assert "another synchronizer" in str(errors[0])
        # A's refit landed whole; B's failure changed nothing of A's.
        assert (sync_a.weight_version, sync_a.is_stale) == (1, False)
        assert (sync_b.weight_version, sync_b.is_stale) == (0, True)
        await h.assert_engine_equals(dense_engine, trainer_a)
        assert all(s["weights_valid"] for s in await dense_engine.status())

        # The worker is free again: B's next sync lands.
        await sync_b.sync_weights()
        assert (sync_b.weight_version, sync_b.is_stale) == (1, False)
        await h.assert_engine_equals(dense_engine, trainer_b)
