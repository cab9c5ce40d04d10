"""The kit's fault cells: ``cancel``, ``killed_worker``, ``bad_manifest``,
``second_owner``.

A sync that does not complete (cancelled, a worker killed, a manifest the engine does
not match, another synchronizer's commit) leaves the version unchanged and the
synchronizer stale, the engine refusing to generate or serving the previous version
exactly; the next sync heals it.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Mapping

import anyio
import anyio.from_thread
import torch

from aiosync import OwnershipError, RefitMismatchError, SyncError, TransportError

from .cases import TransportCase
from .engines import EmbeddedKitEngine, KitEngine, LoRAKitEngine
from .sync_checks import _assert_serves, _sync
from .trainers import PROMPTS, KitTrainer


def _cancel_at(scope: anyio.CancelScope, at: int) -> Callable[[int], None]:
    def hook(i: int) -> None:
        if i != at:
            return
        try:
            anyio.from_thread.run_sync(scope.cancel)  # the source runs in a worker thread
        except RuntimeError:
            scope.cancel()  # the source runs on the event loop

    return hook


async def _assert_refuses_or_serves(
    engine: KitEngine, before: Mapping[str, torch.Tensor], version: int
) -> None:
    """The engine refuses to generate, or serves ``version`` holding ``before`` exactly."""
    from aiosync import SyncError

    try:
        generations = await engine.generate(PROMPTS, 2)
    except SyncError:
        return
    assert {g.last_version for g in generations} == {version}
    assert await engine.holds(before)


async def check_cancel(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A sync cancelled while the source yields its 6th tensor (buckets already moved):
    the cancellation propagates, ``is_stale`` stays True and the version at 1, the
    engine refuses to generate or serves version 1 exactly; the next sync heals it."""
    async with case.build(trainer, engine) as sync:
        await _sync(sync)
        v1 = trainer.state()
        trainer.step(seed=7)
        await sync.mark_stale()
        with anyio.CancelScope() as scope:
            trainer.on_tensor = _cancel_at(scope, 6)
            await sync.sync_weights()
        trainer.on_tensor = None
        assert scope.cancelled_caught
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        await _assert_refuses_or_serves(engine, v1, 1)
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)


async def check_killed_worker(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """An engine worker SIGKILLed while the source yields its 6th tensor: the sync fails
    typed (:class:`~aiosync.TransportError`), ``is_stale`` stays True and the version at
    1; once the engine respawned the worker's replica, a re-initialized synchronizer
    heals every worker and the engine serves the new version. (Engines that respawn
    workers: the embedded one.) An adapter-only refit cannot restore the respawned
    worker's base weights: its sync is refused (``SyncError``) until they are loaded
    again, as a full refit would."""
    assert isinstance(engine, EmbeddedKitEngine)
    async with case.build(trainer, engine) as sync:
        await _sync(sync)
        victim = engine.workers - 1
        pid = engine.generation.pids[victim]

        def kill(i: int) -> None:
            if i == 6:
                os.kill(pid, signal.SIGKILL)

        trainer.step(seed=9)
        await sync.mark_stale()
        trainer.on_tensor = kill
        try:
            await sync.sync_weights()
        except TransportError:
            pass
        else:
            raise AssertionError(f"{case.name} committed a sync its worker died in")
        finally:
            trainer.on_tensor = None
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        # The dead worker's replica comes back whole (its tensor-parallel ranks).
        tp = engine.generation.tensor_parallel_size
        replica = [r for r in range(engine.workers) if r // tp == victim // tp]
        assert await engine.generation.respawn_dead_workers() == replica
        await sync.init_communicator()
        if isinstance(engine, LoRAKitEngine):
            try:
                await sync.sync_weights()
            except SyncError as error:
                want = f"worker {victim}: the base weights are not valid"
                assert want in str(error) and "cannot restore them" in str(error), error
            else:
                raise AssertionError("an adapter landed on a respawned worker's lost base")
            assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
            await engine.restore_base()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)


async def check_bad_manifest(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A manifest naming a tensor the engine lacks: ``RefitMismatchError`` naming it,
    version 0, and the engine's weights untouched."""
    before = await engine.states()
    trainer.rename = dict(trainer.renames)
    sync = case.build(trainer, engine)
    try:
        async with sync:
            await _sync(sync)
    except RefitMismatchError as error:
        # Named (a full checkpoint both ways: the engine lacks the new name, the
        # trainer the old one).
        assert all(name in str(error) for name in trainer.refusal_names), str(error)
    else:
        raise AssertionError(f"{case.name} synced a manifest the engine does not match")
    finally:
        trainer.rename = {}
    assert sync.weight_version == 0
    after = await engine.states()
    assert all(torch.equal(a[n], b[n]) for a, b in zip(before, after, strict=True) for n in a)


async def check_second_owner(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A second synchronizer of another trainer (a restarted one, versions from 0) on an
    engine the first owns (case C27): never both commit, and the engine's version labels
    follow the synchronizer that owns it.

    A transport that holds a sync group on the workers (the non-colocated ones) refuses
    the second at init (:class:`~aiosync.OwnershipError`, "another synchronizer") while
    the first lives, and the first keeps syncing undisturbed; once the first shut down,
    the second takes the engine over. One that holds nothing between syncs (colocated)
    lets the second commit: the first turns stale, its next sync is refused naming the
    second's owner token and version before any byte moves, and its
    ``init_communicator()`` takes the engine over again (the second is refused then)."""
    other = case.trainer(77)
    async with case.build(trainer, engine) as first:
        await _sync(first)
        second = case.build(other, engine)
        if not case.colocated:
            try:
                async with second:
                    raise AssertionError(f"{case.name} let a second synchronizer in")
            except OwnershipError as error:
                # The holder named: the workers' group ("another synchronizer"), or
                # SGLang's weight-update group ("for a live trainer").
                assert re.search("another synchronizer|for a live trainer", str(error)), error
            assert second.weight_version == 0
            trainer.step(seed=2)
            await _sync(first)
            assert (first.weight_version, first.is_stale) == (2, False)
            assert await engine.holds(trainer.state())
            await _assert_serves(engine, trainer, 2)
        else:
            async with second:
                assert (second.weight_version, second.is_stale) == (0, True)
                await _sync(second)
                assert (second.weight_version, second.is_stale) == (1, False)
                assert await engine.holds(other.state())
                await _assert_serves(engine, other, 1)
                assert (first.weight_version, first.is_stale) == (1, True)
                trainer.step(seed=2)
                await first.mark_stale()
                try:
                    await first.sync_weights()
                except OwnershipError as error:
                    want = f"owner {second.owner}) committed its version 1"
                    assert want in str(error), str(error)
                else:
                    raise AssertionError(f"{case.name} synced over another's commit")
                assert (first.weight_version, first.is_stale) == (1, True)
                assert await engine.holds(other.state())  # refused before any byte
                await first.init_communicator()  # the explicit take-over
                await first.sync_weights()
                assert (first.weight_version, first.is_stale) == (2, False)
                assert await engine.holds(trainer.state())
                await _assert_serves(engine, trainer, 2)
                assert second.is_stale
                try:
                    await second.sync_weights()
                except OwnershipError as error:
                    assert "no longer owns its engine" in str(error), str(error)
                else:
                    raise AssertionError(f"{case.name} synced over another's commit")
            return
    # The first is gone (shut down): the second takes its engine over.
    async with case.build(other, engine) as second:
        await _sync(second)
        assert (second.weight_version, second.is_stale) == (1, False)
        assert await engine.holds(other.state())
        await _assert_serves(engine, other, 1)
