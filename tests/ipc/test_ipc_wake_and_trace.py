"""The wake RPCs a sync skips when the engine reports it is awake, and the sync trace."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from aiosync.engines.embedded.engine import EmbeddedEngine
from tests._support.proxy import EngineProxy
from tests._support.steps import first_sync, sleep_at_level_2

pytestmark = pytest.mark.asyncio(loop_scope="session")

BOTH_WAKES = ["prepare_for_generation(weights)", "prepare_for_generation(kv_cache)"]


class SleepTrackingEngine(EngineProxy):
    """A real :class:`EmbeddedEngine`, logging the wakes a sync asks for. Its
    ``asleep_tags`` are the engine's own (every tag from ``finish_generation()``
    on, a tag awake once ``prepare_for_generation`` woke it); ``track=False``
    reports ``None`` (unknown), as an engine without the attribute. The rest (pause and
    resume, on_weights_committed, the discard listeners, generate, status) is the
    engine's."""

    def __init__(self, engine: EmbeddedEngine, *, track: bool = True) -> None:
        super().__init__(engine)
        self.track = track
        self.log: list[str] = []

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        return self.engine.asleep_tags if self.track else None

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        self.log.append(f"prepare_for_generation({','.join(tags) if tags else 'all'})")
        await self.engine.prepare_for_generation(tags)

    async def finish_generation(self) -> None:
        await self.engine.finish_generation()


@contextlib.asynccontextmanager
async def _tracked_sync(
    h: SimpleNamespace, dense_engine: EmbeddedEngine, seed: int
) -> AsyncIterator[tuple[Any, SleepTrackingEngine, Any]]:
    """A trainer (``seed``) synced once over IPC into ``dense_engine`` behind a
    :class:`SleepTrackingEngine`: the trainer, the tracking engine, the synchronizer."""
    trainer = h.trainer_model(h.DENSE_TIED, seed=seed)
    engine = SleepTrackingEngine(dense_engine)
    async with h.ipc_sync(trainer, engine, bucket_bytes=1 << 20) as sync:
        await first_sync(sync)
        yield trainer, engine, sync


async def test_an_engine_that_reports_itself_awake_is_not_woken_around_a_sync(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with _tracked_sync(h, dense_engine, 50) as (trainer, engine, sync):
        assert engine.log == []
        assert sync.weight_version == 1
        await h.assert_engine_equals(dense_engine, trainer)
        assert [s["asleep"] for s in await dense_engine.status()] == [[]]


async def test_an_engine_that_slept_at_level_2_is_woken_and_refit_by_the_sync(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with _tracked_sync(h, dense_engine, 51) as (trainer, engine, sync):
        await sleep_at_level_2(dense_engine, through=engine)
        assert engine.asleep_tags == frozenset({"weights", "kv_cache"})
        assert [s["asleep"] for s in await dense_engine.status()] == [["kv_cache", "weights"]]
        assert sync.is_stale
        await sync.sync_weights()
        assert engine.log == BOTH_WAKES
        assert engine.asleep_tags == frozenset()
        [status] = await dense_engine.status()
        assert (status["asleep"], status["weights_valid"]) == ([], True)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await h.assert_engine_equals(dense_engine, trainer)
        rollouts = await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
        assert [len(r) for r in rollouts] == [2] * len(h.PROMPTS)


async def test_an_engine_whose_sleep_is_unknown_is_woken_around_every_sync(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=52)
    engine = SleepTrackingEngine(dense_engine, track=False)
    async with h.ipc_sync(trainer, engine, bucket_bytes=1 << 20) as sync:
        await sync.init_communicator()
        for _ in range(2):
            await sync.mark_stale()
            await sync.sync_weights()
        assert engine.log == BOTH_WAKES * 2
        await h.assert_engine_equals(dense_engine, trainer)


TRAINER_KEYS = {"seq", "bucket", "bytes", "copied", "pack_start", "pack_end", "sent", "acked"}
WORKER_KEYS = {"seq", "received", "load_start", "load_end", "ack_sent"}


async def test_a_traced_sync_records_every_bucket_on_both_sides_in_causal_order(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=53)
    # 12 KiB buckets: several through the two ping-pong buffers, the large
    # tensors in buffers of their own.
    async with h.ipc_sync(trainer, dense_engine, bucket_bytes=12288) as sync:
        await sync.init_communicator()
        assert sync.plan is not None
        count = len(sync.plan.buckets)
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.last_trace is None  # off by default
        [last] = await dense_engine.collective_rpc("aiosync_ipc_last_receive")
        assert "trace" not in last

        sync.trace = True
        await sync.mark_stale()
        await sync.sync_weights()
        await h.assert_engine_equals(dense_engine, trainer)
        trace = sync.last_trace
        assert trace is not None
        assert trace["clock"] == "time.monotonic"
        rows = trace["trainer"]
        assert [row["seq"] for row in rows] == list(range(count))
        assert [row["bucket"] for row in rows] == [b.index for b in sync.plan.buckets]
        assert [row["bytes"] for row in rows] == [b.nbytes for b in sync.plan.buckets]
        assert all(set(row) == TRAINER_KEYS for row in rows)
        # A plain model's tensors are packed: every tensor byte is copied once.
        assert [row["copied"] for row in rows] == [
            sum(slot.nbytes for slot in b.slots) for b in sync.plan.buckets
        ]
        assert list(trace["workers"]) == [0]
        loads = trace["workers"][0]
        assert [row["seq"] for row in loads] == list(range(count))
        assert all(set(row) == WORKER_KEYS for row in loads)
        # One clock for both processes (CLOCK_MONOTONIC): causality holds across them.
        for sent, load in zip(rows, loads, strict=True):
            assert sent["pack_start"] <= sent["pack_end"] <= sent["sent"] <= load["received"]
            assert load["received"] <= load["load_start"] <= load["load_end"]
            assert load["load_end"] <= load["ack_sent"] <= sent["acked"]
