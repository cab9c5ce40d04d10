"""The kit's ``elastic`` cell: a quarantining fleet sets a killed engine aside, named,
and commits to the other; revived, it joins with the next sync; one killed while
serving fails the fleet's generate, named (cases C29, C36, C40)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from aiosync import TransportError, VersionEventKind

from .cases import TransportCase
from .engines import FleetKitEngine, KitEngine
from .sync_checks import _assert_serves, _sync
from .trainers import LONG, LONG_PROMPT, STARTED, KitTrainer


async def _events_until(
    events: Any, kind: VersionEventKind, version: int
) -> list[tuple[VersionEventKind, int, str | None]]:
    """The events up to the first ``kind`` of ``version``: ``(kind, version, engine)``."""
    seen = []
    with anyio.fail_after(60):
        async for event in events:
            seen.append((event.kind, event.version, event.engine))
            if (event.kind, event.version) == (kind, version):
                return seen
    raise AssertionError(f"the events ended before {kind} {version}: {seen}")


def _once_at(index: int, call: Callable[[], None]) -> Callable[[int], None]:
    """A source hook: ``call()`` at the ``index``-th tensor, once (a quarantine's
    second round iterates the source again)."""
    done: list[bool] = []

    def hook(i: int) -> None:
        if i == index and not done:
            done.append(True)
            call()

    return hook


async def _committed_without(
    dead: Mapping[str, KitEngine],
    version: int,
    sync: Any,
    fleet: FleetKitEngine,
    engine: KitEngine,
    trainer: KitTrainer,
    events: Any,
) -> None:
    """``version`` committed on ``engine`` alone: the fleet set ``dead`` aside (by label,
    each reason saying how it died; an ``ENGINE_QUARANTINED`` event of ``version`` for
    the last), ``engine`` holds the trainer's tensors and the fleet serves them."""
    members = fleet.generation
    assert (sync.weight_version, sync.is_stale) == (version, False)
    assert list(members.quarantined) == list(dead)
    for label, member in dead.items():
        assert member.death in members.quarantined[label], members.quarantined
    assert members.serving == [engine.generation]
    seen = await _events_until(events, VersionEventKind.COMMITTED, version)
    assert (VersionEventKind.ENGINE_QUARANTINED, version, list(dead)[-1]) in seen
    assert await engine.holds(trainer.state())
    await _assert_serves(fleet, trainer, version)


async def check_elastic(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared (``elastic``): the kit's engine and a spare behind
    ``EngineFleet(on_engine_failure="quarantine")`` (cases C29, C36, C40).

    The spare (engine 0: the survivor's ranks move) killed mid-sync is set aside,
    named (``ENGINE_QUARANTINED``), and the same ``sync_weights()`` commits version 2
    on the other: bit-exact, served. Revived (its workers respawned: it leaves the
    quarantine; or a fresh server) and added, it joins with the next sync
    (``COMMITTED`` then ``ENGINE_JOINED``) and serves only once that committed. Killed
    while serving, it fails the fleet's generate, named (:class:`~aiosync.TransportError`);
    between syncs it fails the pause and is set aside likewise: version 4 commits on the
    other, which the fleet serves at once; reviving it changes nothing served."""
    async with contextlib.AsyncExitStack() as stack:
        spare = await stack.enter_async_context(engine.spare())
        fleet = FleetKitEngine([spare, engine], on_engine_failure="quarantine")
        members = fleet.generation
        victim = fleet.label(spare)
        sync = await stack.enter_async_context(case.build(trainer, fleet))
        events = await stack.enter_async_context(sync.subscribe())
        await _sync(sync)
        assert [await e.holds(trainer.state()) for e in (engine, spare)] == [True, True]

        trainer.step(seed=11)
        trainer.on_tensor = _once_at(6, spare.kill)
        try:
            await _sync(sync)  # commits on the kit's engine
        finally:
            trainer.on_tensor = None
        await _committed_without({victim: spare}, 2, sync, fleet, engine, trainer, events)

        joiner = await spare.revive(stack)
        members.add_engine(joiner.generation)
        assert members.serving == [engine.generation]  # joining: no generate calls yet
        joined = fleet.label(joiner)
        trainer.step(seed=12)
        await _sync(sync)
        assert (sync.weight_version, sync.is_stale) == (3, False)
        assert {id(e) for e in members.serving} == {id(engine.generation), id(joiner.generation)}
        # A fresh server joined: the killed one stays set aside, named anew (the fleet grew).
        gone = {} if joiner is spare else {fleet.label(spare): spare}
        assert list(members.quarantined) == list(gone)
        seen = await _events_until(events, VersionEventKind.ENGINE_JOINED, 3)
        assert seen[-2:] == [
            (VersionEventKind.COMMITTED, 3, None),
            (VersionEventKind.ENGINE_JOINED, 3, joined),
        ]
        assert [await e.holds(trainer.state()) for e in (engine, joiner)] == [True, True]
        await _assert_serves(fleet, trainer, 3)

        # Dead while serving (C40): the fleet's generate fails naming it; the next
        # sync's pause fails on it and it is set aside before any byte.
        failures: list[BaseException] = []

        async def serve() -> None:
            try:
                await fleet.generate([LONG_PROMPT] * 2, LONG)  # one request per engine
            except TransportError as error:
                failures.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            with anyio.fail_after(120):
                while await joiner.decoded() < STARTED:
                    await anyio.sleep(0.005)
            joiner.kill()
        (failure,) = failures
        assert str(failure).startswith(f"{joined}: "), failure
        trainer.step(seed=13)
        await _sync(sync)
        dead = {**gone, joined: joiner}
        await _committed_without(dead, 4, sync, fleet, engine, trainer, events)
        # Reviving the set-aside engine changes nothing the fleet serves.
        await joiner.revive(stack)  # (and leaves the spare whole for its close)
        assert (sync.weight_version, sync.is_stale) == (4, False)


#: The in-flight cells' request: its prompt and length (tokens; long enough that the
