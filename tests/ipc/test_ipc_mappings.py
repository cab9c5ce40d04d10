"""The worker keeps its mappings of the trainer's shared buffers between syncs, and drops them."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = pytest.mark.asyncio(loop_scope="session")


class RpcLog:
    """Forwards to an :class:`EmbeddedEngine`, recording each ``collective_rpc``'s replies."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.replies: list[tuple[str, list[Any]]] = []

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        replies = await self.engine.collective_rpc(method, args, kwargs, timeout_s)
        self.replies.append((method, replies))
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


async def test_kept_mappings_carry_each_new_version_and_are_released_at_shutdown(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=60)
    engine = RpcLog(dense_engine)
    # 12 KiB buckets: many buckets through the two ping-pong buffers.
    async with IPCWeightSynchronizer(
        h.TrainerSource(trainer.model, []), engine, bucket_bytes=12288
    ) as sync:
        await sync.init_communicator()
        for step in range(3):
            await sync.mark_stale()
            await sync.sync_weights()
            # Every sync lands bit-exact through the mappings the worker kept.
            await h.assert_engine_equals(dense_engine, trainer)
            with torch.no_grad():
                for parameter in trainer.model.parameters():
                    parameter.add_(step + 1.0)
        assert sync.weight_version == 3
    released = [replies for method, replies in engine.replies if method == "aiosync_ipc_release"]
    assert released == [[{"ok": True, "rank": 0, "released": 2}]]


async def test_a_release_of_another_owner_drops_nothing(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=61)
    engine = RpcLog(dense_engine)
    async with IPCWeightSynchronizer(
        h.TrainerSource(trainer.model, []), engine, bucket_bytes=12288
    ) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        assert await dense_engine.collective_rpc("aiosync_ipc_release", ("not-the-owner",)) == [
            {"ok": True, "rank": 0, "released": 0}
        ]
        await sync.mark_stale()
        await sync.sync_weights()
        await h.assert_engine_equals(dense_engine, trainer)
    released = [replies for method, replies in engine.replies if method == "aiosync_ipc_release"]
    assert released == [[{"ok": True, "rank": 0, "released": 2}]]
