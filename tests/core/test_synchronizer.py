"""The WeightSynchronizer contract: versions, handshake, failure, cancellation, coalescing."""

from __future__ import annotations

import math

import anyio
import pytest

from aiosync import (
    SyncError,
    SyncTimeoutError,
    VersionEventKind,
    refit_if_stale,
)


async def test_versions_start_at_zero_and_not_stale(sync):
    assert (sync.policy_version, sync.weight_version, sync.is_stale) == (0, 0, False)


async def test_mark_stale_advances_by_one_and_returns_the_version(sync):
    assert await sync.mark_stale() == 1
    assert await sync.mark_stale() == 2
    assert (sync.policy_version, sync.weight_version, sync.is_stale) == (2, 0, True)


async def test_mark_stale_to_explicit_version_must_go_up(sync):
    assert await sync.mark_stale(7) == 7
    with pytest.raises(ValueError, match="greater than policy_version=7"):
        await sync.mark_stale(7)
    with pytest.raises(ValueError):
        await sync.mark_stale(3)
    with pytest.raises(TypeError):
        await sync.mark_stale(True)  # type: ignore[arg-type]
    assert sync.policy_version == 7


async def test_handshake_refits_then_prepares_generation(sync, source, engine, holds):
    source.step()
    await sync.mark_stale()
    assert await refit_if_stale(sync, engine) is True
    assert holds(engine, source)
    assert (sync.weight_version, sync.is_stale) == (1, False)
    assert engine.calls == [("prepare_for_generation", None)]
    assert await refit_if_stale(sync, engine) is False
    assert engine.calls == [("prepare_for_generation", None)]
    assert sync.transfers == [1]


async def test_handshake_defaults_to_the_synchronizers_engine(sync, source, engine, holds):
    source.step()
    await sync.mark_stale()
    assert await refit_if_stale(sync) is True
    assert engine.calls == [("prepare_for_generation", None)]
    assert sync.weight_version == 1 and holds(engine, source)


async def test_handshake_refuses_a_plain_list_before_syncing(sync, engine):
    await sync.mark_stale()
    with pytest.raises(TypeError, match=r"for a fleet pass sync\.generation"):
        await refit_if_stale(sync, [engine])  # type: ignore[arg-type]
    assert sync.transfers == [] and sync.weight_version == 0


async def test_sync_when_not_stale_moves_nothing(sync):
    await sync.sync_weights()
    assert sync.transfers == []


async def test_sync_before_init_communicator_raises(make_sync):
    s = make_sync()
    await s.mark_stale()
    with pytest.raises(SyncError, match="init_communicator"):
        await s.sync_weights()
    assert s.transfers == []


async def test_failed_sync_keeps_version_and_stays_stale(sync, source, engine, holds):
    source.step()
    await sync.mark_stale()
    sync.fail_after_entries = 1
    with pytest.raises(RuntimeError, match="link dropped after 1"):
        await sync.sync_weights()
    assert (sync.policy_version, sync.weight_version, sync.is_stale) == (1, 0, True)
    assert not holds(engine, source)  # half-updated: one entry of two
    sync.fail_after_entries = None
    await sync.sync_weights()
    assert (sync.weight_version, sync.is_stale) == (1, False)
    assert holds(engine, source)


async def test_half_failed_resync_of_current_version_marks_engine_stale(sync, source):
    source.step()
    await sync.mark_stale()
    await sync.sync_weights()
    assert not sync.is_stale
    # The engine discarded its weights (e.g. woken after a level-2 sleep).
    sync._invalidate_engine_weights()
    assert sync.is_stale and sync.weight_version == 1
    sync.fail_after_entries = 1
    with pytest.raises(RuntimeError):
        await sync.sync_weights()
    assert sync.is_stale and sync.weight_version == 1
    sync.fail_after_entries = None
    await sync.sync_weights()
    assert not sync.is_stale and sync.transfers == [1, 1, 1]


async def _start_held(sync, tg):
    """Mark ``sync`` stale and start its sync in ``tg``, held at its gate (set it to go on)."""
    await sync.mark_stale()
    sync.gate = anyio.Event()
    tg.start_soon(sync.sync_weights)
    await sync.started.wait()


async def test_cancelled_sync_keeps_version_and_reports_failed(sync):
    sync.gate = anyio.Event()
    async with sync.subscribe() as events:
        await sync.mark_stale()
        with anyio.move_on_after(5) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sync.sync_weights)
                await sync.started.wait()
                tg.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert (sync.weight_version, sync.is_stale) == (0, True)
        with anyio.fail_after(5):
            kinds = [(await events.__anext__()).kind for _ in range(3)]
    assert kinds == [VersionEventKind.STALE, VersionEventKind.SYNC_STARTED, VersionEventKind.FAILED]
    sync.gate = None
    await sync.sync_weights()
    assert sync.weight_version == 1


async def test_sync_past_its_timeout_raises_sync_timeout_error(make_sync):
    s = make_sync(sync_timeout_s=0.05)
    await s.init_communicator()
    await s.mark_stale()
    s.gate = anyio.Event()  # never set: the engine stopped answering (case C2)
    with pytest.raises(SyncTimeoutError, match=r"exceeded 0\.05 s") as info:
        await s.sync_weights()
    assert isinstance(info.value, TimeoutError)
    assert (s.weight_version, s.is_stale) == (0, True)


async def test_concurrent_syncs_coalesce_into_one_transfer(sync):
    async with anyio.create_task_group() as tg:
        await _start_held(sync, tg)
        tg.start_soon(sync.sync_weights)
        tg.start_soon(sync.sync_weights)
        await anyio.sleep(0.01)
        sync.gate.set()
    assert sync.transfers == [1]
    assert sync.weight_version == 1


async def test_mark_stale_during_sync_leaves_it_stale_and_waiter_syncs_again(sync):
    async with anyio.create_task_group() as tg:
        await _start_held(sync, tg)
        assert await sync.mark_stale() == 2
        tg.start_soon(sync.sync_weights)  # waits for the first, then moves version 2
        await anyio.sleep(0.01)
        sync.gate.set()
    assert sync.transfers == [1, 2]
    assert (sync.weight_version, sync.is_stale) == (2, False)


async def test_sync_commits_the_version_seen_at_start(sync):
    async with anyio.create_task_group() as tg:
        await _start_held(sync, tg)
        await sync.mark_stale(5)
        sync.gate.set()
    assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 5, True)


async def test_weights_discarded_during_a_sync_fail_it_instead_of_committing(sync):
    # Case C14 at the synchronizer: an invalidation after the sync began is not lost.
    sync.gate = anyio.Event()
    events = []
    async with sync.subscribe() as stream, anyio.create_task_group() as tg:
        await sync.mark_stale()

        async def run() -> None:
            with pytest.raises(SyncError, match="discarded its weights while version 1"):
                await sync.sync_weights()

        tg.start_soon(run)
        await sync.started.wait()
        sync._invalidate_engine_weights()  # the engine discarded its weights mid-sync
        sync.gate.set()
        async for event in stream:
            events.append(event.kind.name)
            if event.kind.name == "FAILED":
                break
    assert sync.transfers == [1]
    assert (sync.weight_version, sync.is_stale) == (0, True)
    assert events == ["STALE", "SYNC_STARTED", "FAILED"]
    await sync.sync_weights()  # nothing discarded this time: it lands
    assert (sync.weight_version, sync.is_stale) == (1, False)


async def test_a_policy_update_waits_for_the_sync_reading_the_source(sync, source, engine):
    # Without it, a step landing between the sync's reads streams a mix of two versions.
    order = []
    async with anyio.create_task_group() as tg:
        await _start_held(sync, tg)  # the sync copied entry "a" and waits before "b"

        async def step() -> None:
            async with sync.policy_update() as version:
                order.append(("step", version))
                source.step()

        tg.start_soon(step)
        await anyio.sleep(0.05)
        order.append(("gate",))
        sync.gate.set()
    assert order == [("gate",), ("step", 2)]
    # The engine holds version 1 whole: every entry from before the step.
    assert {k: v.tolist() for k, v in engine.weights.items()} == {
        "a": [0.0] * 4,
        "b": [[0.0, 0.0], [0.0, 0.0]],
    }
    assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
    sync.gate = None
    await sync.sync_weights()
    assert engine.weights["a"].tolist() == [1.0] * 4 and sync.weight_version == 2


async def test_a_sync_started_during_a_policy_update_moves_and_names_the_new_version(
    sync, source, engine
):
    await sync.mark_stale()
    async with anyio.create_task_group() as tg, sync.policy_update() as version:
        tg.start_soon(sync.sync_weights)
        await anyio.sleep(0.05)
        assert sync.transfers == []  # held off until the step is done
        source.step()
    assert version == 2
    assert sync.transfers == [2] and sync.weight_version == 2
    assert engine.weights["a"].tolist() == [1.0] * 4


async def test_a_failed_policy_update_marks_nothing(sync):
    with pytest.raises(RuntimeError, match="nan loss"):
        async with sync.policy_update():
            raise RuntimeError("nan loss")
    assert sync.policy_version == 0


@pytest.mark.parametrize(
    ("kv_scales", "error"),
    [
        ([1.0], TypeError),
        ({0: "1.0"}, TypeError),
        ({1.5: 1.0}, TypeError),
        ({0: -1.0}, ValueError),
        ({0: math.nan}, ValueError),
        ({0: math.inf}, ValueError),
    ],
)
async def test_bad_kv_scales_rejected_before_any_transfer(sync, kv_scales, error):
    await sync.mark_stale()
    with pytest.raises(error):
        await sync.sync_weights(kv_scales)
    assert sync.transfers == [] and sync.weight_version == 0


async def test_kv_scales_reach_the_transport(sync):
    await sync.mark_stale()
    await sync.sync_weights({0: 0.5, "model.layers.1.self_attn.k_scale": 0.25})
    assert sync.kv_scales_seen == [{0: 0.5, "model.layers.1.self_attn.k_scale": 0.25}]


async def test_shutdown_is_idempotent_and_final(make_sync):
    s = make_sync()
    await s.init_communicator()
    await s.shutdown()
    await s.shutdown()
    with pytest.raises(SyncError, match="shut down"):
        await s.mark_stale()
    with pytest.raises(SyncError, match="shut down"):
        await s.sync_weights()


async def test_async_context_manager_shuts_down(make_sync):
    async with make_sync() as s:
        await s.init_communicator()
        await s.mark_stale()
        await s.sync_weights()
        assert s.weight_version == 1
    with pytest.raises(SyncError):
        await s.mark_stale()


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, "5"])
def test_sync_timeout_must_be_a_finite_positive_number(make_sync, timeout):
    with pytest.raises(ValueError, match="sync_timeout_s"):
        make_sync(sync_timeout_s=timeout)


def test_event_backlog_is_checked_at_construction(make_sync):
    with pytest.raises(ValueError, match="event_backlog"):
        make_sync(event_backlog=0)
    with pytest.raises(TypeError, match="event_backlog"):
        make_sync(event_backlog=2.5)
