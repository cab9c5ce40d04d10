"""The weight-version event stream: order, late and slow subscribers, overflow, shutdown."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from aiosync import VersionEventKind as K
from aiosync import WeightVersionEvent


async def drain(events, n):
    with anyio.fail_after(5):
        return [await events.__anext__() for _ in range(n)]


async def test_events_arrive_in_order_with_versions_and_bytes(sync):
    async with sync.subscribe() as events:
        await sync.mark_stale()
        await sync.sync_weights()
        sync.fail_after_entries = 0
        await sync.mark_stale()
        with pytest.raises(RuntimeError):
            await sync.sync_weights()
        got = await drain(events, 6)
    assert [(e.kind, e.version) for e in got] == [
        (K.STALE, 1),
        (K.SYNC_STARTED, 1),
        (K.COMMITTED, 1),
        (K.STALE, 2),
        (K.SYNC_STARTED, 2),
        (K.FAILED, 2),
    ]
    committed, failed = got[2], got[5]
    assert committed.nbytes == 4 * 4 + 4 * 4  # float32 [4] and [2, 2]
    assert (committed.policy_version, committed.weight_version) == (1, 1)
    assert committed.duration_s > 0 and committed.error is None
    assert failed.error == "RuntimeError('link dropped after 0 entries')"
    assert (failed.policy_version, failed.weight_version, failed.nbytes) == (2, 1, 0)
    assert [e.timestamp for e in got] == sorted(e.timestamp for e in got)


async def test_late_subscriber_reads_current_versions_first(sync):
    await sync.mark_stale()
    await sync.sync_weights()
    await sync.mark_stale()
    async with sync.subscribe() as events:
        assert (events.policy_version, events.weight_version) == (2, 1)
        await sync.sync_weights()
        got = await drain(events, 2)
    assert [(e.kind, e.version) for e in got] == [(K.SYNC_STARTED, 2), (K.COMMITTED, 2)]


async def test_slow_subscriber_gets_overflow_event_then_new_events(sync):
    async with sync.subscribe(max_backlog=2) as events:
        for _ in range(5):
            await sync.mark_stale()  # STALE 1..5: 1, 2 buffered; 3, 4, 5 missed
        first = await drain(events, 2)
        assert [(e.kind, e.version) for e in first] == [(K.STALE, 1), (K.STALE, 2)]
        overflow = (await drain(events, 1))[0]
        assert overflow.kind is K.OVERFLOW
        assert (overflow.missed, overflow.policy_version, overflow.weight_version) == (3, 5, 0)
        await sync.sync_weights()
        after = await drain(events, 2)
    assert [(e.kind, e.version) for e in after] == [(K.SYNC_STARTED, 5), (K.COMMITTED, 5)]


async def test_one_subscriber_overflowing_leaves_the_others_whole(sync):
    async with sync.subscribe(max_backlog=1) as slow, sync.subscribe(max_backlog=8) as fast:
        for _ in range(4):
            await sync.mark_stale()  # slow: 1 buffered, 2..4 missed
        assert [e.version for e in await drain(fast, 4)] == [1, 2, 3, 4]
        assert [(e.kind, e.missed) for e in await drain(slow, 2)] == [
            (K.STALE, 0),
            (K.OVERFLOW, 3),
        ]
        await sync.mark_stale()  # slow reads again: both get it
        got = (await drain(slow, 1))[0], (await drain(fast, 1))[0]
    assert [(e.kind, e.version) for e in got] == [(K.STALE, 5), (K.STALE, 5)]


async def test_events_after_a_gap_wait_for_the_overflow_notice(sync):
    async with sync.subscribe(max_backlog=1) as events:
        await sync.mark_stale()  # buffered
        await sync.mark_stale()  # missed
        first = await drain(events, 1)
        await sync.mark_stale()  # buffer has room, but it follows a gap: counted as missed
        rest = await drain(events, 1)
    assert first[0].version == 1
    assert (rest[0].kind, rest[0].missed, rest[0].policy_version) == (K.OVERFLOW, 2, 3)


async def test_subscriber_that_never_reads_does_not_block_syncs(sync):
    async with sync.subscribe(max_backlog=1):
        for _ in range(200):
            await sync.mark_stale()
            await sync.sync_weights()
    assert sync.weight_version == 200 and sync.transfers == list(range(1, 201))


async def test_shutdown_ends_every_subscription_after_buffered_events(make_sync):
    s = make_sync()
    await s.init_communicator()
    a, b = s.subscribe(), s.subscribe()
    await s.mark_stale()
    seen: dict[str, list] = {"a": [], "b": []}

    async def consume(name, events):
        async for ev in events:
            seen[name].append((ev.kind, ev.version))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "a", a)
            tg.start_soon(consume, "b", b)
            await anyio.sleep(0.01)
            await s.shutdown()
    assert seen == {"a": [(K.STALE, 1)], "b": [(K.STALE, 1)]}
    late = s.subscribe()
    with pytest.raises(StopAsyncIteration):
        await late.__anext__()


async def test_unsubscribed_stream_receives_nothing_more(sync):
    events = sync.subscribe()
    await events.aclose()
    await sync.mark_stale()
    assert not sync._events._subscriptions
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()


async def test_every_subscriber_reads_every_event_in_order_while_syncs_run(sync):
    # Readers run concurrently with the syncs (most of them parked in receive()
    # when an event is published), as in the fan-out benchmark.
    subs = [sync.subscribe() for _ in range(50)]
    seen: list[list[tuple[K, int]]] = [[] for _ in subs]

    async def read(i, events):
        async for ev in events:
            seen[i].append((ev.kind, ev.version))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i, events in enumerate(subs):
                tg.start_soon(read, i, events)
            for _ in range(20):
                await sync.mark_stale()
                await sync.sync_weights()
                await anyio.sleep(0)
            await sync.shutdown()
    expected = [(k, v) for v in range(1, 21) for k in (K.STALE, K.SYNC_STARTED, K.COMMITTED)]
    assert seen == [expected] * 50


async def test_cancelled_reader_loses_no_event(sync):
    async with sync.subscribe() as events:

        async def read_once():
            await events.__anext__()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_once)
            await anyio.sleep(0.01)  # parked in receive()
            tg.cancel_scope.cancel()
        await sync.mark_stale()
        got = await drain(events, 1)
    assert [(e.kind, e.version) for e in got] == [(K.STALE, 1)]


async def test_events_are_typed_and_frozen(sync):
    # One event object goes to every subscriber: it must not be mutable.
    async with sync.subscribe() as a, sync.subscribe() as b:
        await sync.mark_stale()
        ev_a, ev_b = (await drain(a, 1))[0], (await drain(b, 1))[0]
    assert isinstance(ev_a, WeightVersionEvent) and ev_a == ev_b
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev_a.version = 7  # type: ignore[misc]


async def test_overflow_notice_comes_before_the_end_of_a_shut_down_stream(make_sync):
    s = make_sync()
    await s.init_communicator()
    events = s.subscribe(max_backlog=1)
    await s.mark_stale()  # buffered
    await s.mark_stale()  # missed
    await s.shutdown()
    got = [ev async for ev in events]
    assert [(e.kind, e.version, e.missed) for e in got] == [(K.STALE, 1, 0), (K.OVERFLOW, 2, 1)]


async def test_subscription_whose_receiving_end_closed_is_dropped(sync):
    events = sync.subscribe()
    events._receive.close()  # not aclose(): the hub still holds it
    await sync.mark_stale()
    assert not sync._events._subscriptions


def test_max_backlog_must_be_positive(sync):
    with pytest.raises(ValueError, match="max_backlog"):
        sync.subscribe(max_backlog=0)
