"""VersionedReplayBuffer driven by a real synchronizer's weight-version events."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from aiosync import SyncError
from aiosync.replay import ReplaySample, VersionedReplayBuffer


async def train_step(sync: Any) -> int:
    """One optimizer step followed by the handshake's ``mark_stale``."""
    sync.policy.step()
    return int(await sync.mark_stale())


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Let the buffer's event task run until ``predicate()`` holds."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.001)


async def test_sample_is_stamped_with_weight_version_live_when_generated(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=4) as buffer:
        buffer.add("gen-under-v0")
        await train_step(sync)
        buffer.add("still-v0-weights")  # the trainer stepped, the engine still serves v0
        await sync.sync_weights()
        assert torch.equal(sync.generation.state["w"], torch.ones(8))
        buffer.add("gen-under-v1")
        assert buffer.versions() == [0, 0, 1]
        batch = buffer.pop_batch_nowait(3)
    assert [(s.item, s.target_weight_version, s.policy_version, s.staleness) for s in batch] == [
        ("gen-under-v0", 0, 1, 1),
        ("still-v0-weights", 0, 1, 1),
        ("gen-under-v1", 1, 1, 0),
    ]


async def test_staleness_is_policy_version_minus_target_weight_version(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=3) as buffer:
        buffer.add("a")
        for _ in range(3):
            await train_step(sync)
        assert buffer.staleness(0) == 3
        (sample,) = buffer.pop_batch_nowait(1)
    assert sample == ReplaySample("a", target_weight_version=0, policy_version=3, staleness=3)
    assert buffer.histogram() == {3: 1}


async def test_commit_of_newer_version_drops_samples_beyond_max_staleness(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=1) as buffer:
        buffer.add("v0")
        await train_step(sync)
        await sync.sync_weights()
        await wait_until(lambda: buffer.stats.commits == 1)
        assert buffer.versions() == [0]  # staleness 1 == max_staleness: kept
        buffer.add("v1")
        await train_step(sync)
        await sync.sync_weights()
        await wait_until(lambda: buffer.stats.commits == 2)
        # Held, not popped: the commit itself dropped the staleness-2 sample.
        assert buffer.versions() == [1]
        assert dict(buffer.stats.dropped) == {2: 1}


async def test_sample_staler_than_max_is_never_handed_out(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=1) as buffer:
        buffer.extend(["x", "y"])
        await train_step(sync)
        await train_step(sync)  # no refit: nothing committed, policy at 2
        with pytest.raises(anyio.WouldBlock):
            buffer.pop_batch_nowait(1)
        with pytest.raises(ValueError, match="usable"):
            buffer.sample(1)
        assert len(buffer) == 0
        assert dict(buffer.stats.dropped) == {2: 2}
        assert buffer.histogram() == {}


async def test_failed_sync_keeps_stamping_the_old_version(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=2) as buffer:
        await train_step(sync)
        sync.fail_next = True
        with pytest.raises(RuntimeError, match="half-way"):
            await sync.sync_weights()
        await wait_until(lambda: buffer.stats.failures == 1)
        assert (buffer.policy_version, buffer.weight_version) == (1, 0)
        buffer.add("after-failure")
        assert buffer.versions() == [0]
        await sync.sync_weights()
        await wait_until(lambda: buffer.stats.commits == 1)
        buffer.add("after-retry")
        assert buffer.versions() == [0, 1]


async def test_subscription_buffer_follows_versions_from_events_only(sync: Any) -> None:
    for _ in range(2):
        await train_step(sync)
        await sync.sync_weights()
    # A late subscriber reads the versions current when it joined.
    buffer: VersionedReplayBuffer[str] = VersionedReplayBuffer(sync.subscribe(), max_staleness=0)
    assert (buffer.policy_version, buffer.weight_version) == (2, 2)
    async with buffer:
        buffer.add("v2")
        await train_step(sync)
        await wait_until(lambda: buffer.policy_version == 3)
        assert buffer.weight_version == 2
        await sync.sync_weights()
        await wait_until(lambda: buffer.weight_version == 3)
        assert buffer.versions() == []
        assert dict(buffer.stats.dropped) == {1: 1}


async def test_overflow_rereads_versions_and_drops_stale_samples(sync: Any) -> None:
    buffer: VersionedReplayBuffer[str] = VersionedReplayBuffer(
        sync.subscribe(max_backlog=2), max_staleness=1
    )
    buffer.add("v0")
    # The buffer's task is not running: 9 events against a backlog of 2.
    for _ in range(3):
        await train_step(sync)
        await sync.sync_weights()
    async with buffer:
        await wait_until(lambda: buffer.stats.overflows == 1)
        assert buffer.stats.missed_events == 7
        assert (buffer.policy_version, buffer.weight_version) == (3, 3)
        assert buffer.versions() == []
        assert dict(buffer.stats.dropped) == {3: 1}


async def test_pop_batch_waits_for_a_full_batch_in_fifo_order(sync: Any) -> None:
    results: list[list[ReplaySample[int]]] = []
    buffer: VersionedReplayBuffer[int] = VersionedReplayBuffer(sync, max_staleness=0)

    async def consume() -> None:
        results.append(await buffer.pop_batch(3))

    async with buffer, anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(3):
            await anyio.sleep(0)
            assert results == []
            buffer.add(i)
    assert [s.item for s in results[0]] == [0, 1, 2]


async def test_wait_below_gives_producer_back_pressure(sync: Any) -> None:
    order: list[str] = []
    async with VersionedReplayBuffer(sync, max_staleness=0) as buffer:
        buffer.extend([1, 2])
        async with anyio.create_task_group() as tg:

            async def produce() -> None:
                await buffer.wait_below(2)
                order.append("produced")

            tg.start_soon(produce)
            await anyio.sleep(0.01)
            order.append("popping")
            buffer.pop_batch_nowait(1)
    assert order == ["popping", "produced"]


async def test_capacity_evicts_the_oldest(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=5, capacity=2) as buffer:
        buffer.extend(["a", "b", "c"])
        assert list(buffer) == [("b", 0), ("c", 0)]
        assert buffer.stats.evicted_for_capacity == 1
        with pytest.raises(ValueError, match="capacity"):
            await buffer.pop_batch(3)


async def test_sample_is_random_without_replacement_and_keeps_samples(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=0) as buffer:
        buffer.extend(range(10))
        picked = buffer.sample(4, rng=random.Random(0))
        assert len({s.item for s in picked}) == 4
        assert [s.item for s in picked] == random.Random(0).sample(range(10), 4)
        assert len(buffer) == 10


async def test_run_ends_when_synchronizer_shuts_down(sync: Any) -> None:
    buffer: VersionedReplayBuffer[int] = VersionedReplayBuffer(sync, max_staleness=0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(buffer.run)
        await sync.shutdown()
    assert buffer.stream_ended
    with pytest.raises(SyncError):
        await sync.mark_stale()


def test_histogram_text_lists_used_and_dropped() -> None:
    from aiosync.events import _EventHub

    buffer: VersionedReplayBuffer[str] = VersionedReplayBuffer(
        _EventHub(lambda: (2, 1)).subscribe(), max_staleness=1
    )
    buffer.extend(["a", "b"], weight_version=1)
    buffer.add("c", weight_version=0)
    buffer.pop_batch_nowait(2)
    assert buffer.format_histogram(width=4).splitlines() == [
        "staleness histogram (2 samples used, max_staleness=1)",
        "    1 | #### 2",
        "  dropped as too stale: 1 {2: 1}; evicted for capacity: 0; overflows: 0",
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_staleness": -1}, ValueError, "max_staleness"),
        ({"max_staleness": 1.5}, TypeError, "max_staleness"),
        ({"max_staleness": 0, "capacity": 0}, ValueError, "capacity"),
    ],
)
async def test_bad_arguments_raise_clear_errors(
    sync: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        VersionedReplayBuffer(sync, **kwargs)


def test_rejects_a_source_that_is_not_a_synchronizer_or_subscription() -> None:
    with pytest.raises(TypeError, match="WeightSynchronizer or an EventSubscription"):
        VersionedReplayBuffer(object(), max_staleness=0)  # type: ignore[arg-type]


async def test_bad_weight_version_and_batch_size_raise(sync: Any) -> None:
    buffer: VersionedReplayBuffer[str] = VersionedReplayBuffer(sync, max_staleness=0)
    with pytest.raises(ValueError, match="weight_version"):
        buffer.add("a", weight_version=-1)
    with pytest.raises(ValueError, match="n must be"):
        buffer.pop_batch_nowait(0)


async def test_drain_returns_every_usable_sample_and_drops_the_rest(sync: Any) -> None:
    async with VersionedReplayBuffer(sync, max_staleness=1) as buffer:
        buffer.add("old")
        await train_step(sync)
        await sync.sync_weights()
        buffer.add("new")
        await train_step(sync)
        assert [(s.item, s.staleness) for s in buffer.drain()] == [("new", 1)]
        assert len(buffer) == 0
        assert dict(buffer.stats.dropped) == {2: 1}
