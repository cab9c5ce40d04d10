"""VersionedReplayBuffer with samples produced by more than one weight version.

A request kept in flight across a refit (``in_flight="keep"``) has tokens from
two versions (``Generation.first_version``/``last_version``); the buffer stamps
it with the oldest by default, so its staleness is never understated.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from aiosync import Generation
from aiosync.replay import ReplaySample, VersionedReplayBuffer


async def train_step(sync: Any) -> int:
    sync.policy.step()
    return int(await sync.mark_stale())


async def _at_version_1(sync: Any) -> None:
    await train_step(sync)
    await sync.sync_weights()
    assert (sync.policy_version, sync.weight_version) == (1, 1)


async def test_a_sample_from_two_versions_is_stamped_with_the_oldest_by_default(
    sync: Any,
) -> None:
    await _at_version_1(sync)
    async with VersionedReplayBuffer(sync, max_staleness=1) as buffer:
        assert buffer.stamp == "oldest"
        buffer.add("kept-across-the-refit", versions=[0, 1])
        buffer.add("one-version", versions=[1, 1])
        assert buffer.versions() == [0, 1]
        assert buffer.stats.spanning == 1
        spanning, single = buffer.pop_batch_nowait(2)
    assert spanning == ReplaySample(
        "kept-across-the-refit",
        target_weight_version=0,
        policy_version=1,
        staleness=1,
        other_weight_version=1,
    )
    assert spanning.spans_versions is True
    assert single == ReplaySample("one-version", 1, 1, 0)
    assert single.spans_versions is False


async def test_stale_by_its_oldest_version_is_dropped_where_newest_would_keep_it(
    sync: Any,
) -> None:
    await _at_version_1(sync)
    oldest = VersionedReplayBuffer(sync, max_staleness=1)
    newest = VersionedReplayBuffer(sync, max_staleness=1, stamp="newest")
    async with oldest, newest:
        for buffer in (oldest, newest):
            buffer.add("kept-across-the-refit", versions=[1, 0])
        await train_step(sync)  # policy 2: 2 steps past version 0, 1 past version 1
        assert oldest.drain() == []
        assert oldest.stats.dropped == {2: 1}
        (sample,) = newest.drain()
    assert sample == ReplaySample("kept-across-the-refit", 1, 2, 1, other_weight_version=0)
    assert newest.histogram() == {1: 1}


async def test_a_group_of_generations_is_stamped_from_all_their_versions(sync: Any) -> None:
    await _at_version_1(sync)
    group = [
        Generation([4, 5], first_version=1, last_version=1),
        Generation([6, 7, 8], first_version=0, last_version=1, version_change_at=2),
    ]
    # None: the engine's initial weights (never synced), the synchronizer's version 0.
    initial = Generation([9], first_version=None, last_version=None)
    async with VersionedReplayBuffer(sync, max_staleness=4) as buffer:
        versions = [v for g in group for v in (g.first_version, g.last_version)]
        buffer.extend([group], versions=versions)
        buffer.add(initial, versions=[initial.first_version, initial.last_version])
        assert list(buffer) == [(group, 0), (initial, 0)]
        first, second = buffer.drain()
    assert (first.target_weight_version, first.other_weight_version) == (0, 1)
    assert (second.target_weight_version, second.other_weight_version) == (0, None)
    assert buffer.stats.spanning == 1


async def test_versions_are_checked_before_anything_is_added(sync: Any) -> None:
    with pytest.raises(ValueError, match="stamp"):
        VersionedReplayBuffer(sync, max_staleness=1, stamp="middle")  # type: ignore[arg-type]
    async with VersionedReplayBuffer(sync, max_staleness=1) as buffer:
        with pytest.raises(ValueError, match="not both"):
            buffer.add("x", weight_version=0, versions=[0])
        with pytest.raises(ValueError, match="at least one"):
            buffer.add("x", versions=[])
        with pytest.raises(ValueError, match="int >= 0"):
            buffer.add("x", versions=[0, -1])
        assert len(buffer) == 0
        await anyio.sleep(0)
