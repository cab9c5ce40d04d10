"""Steps several folders' tests take the same way."""

from __future__ import annotations

from typing import Any

__all__ = ["first_sync", "resync", "sleep_at_level_2", "sync_catching"]


async def first_sync(sync: Any) -> None:
    """Initialise ``sync`` (``init_communicator``) and run its first sync
    (``mark_stale``, then ``sync_weights``): what a test does before the step it checks."""
    await sync.init_communicator()
    await sync.mark_stale()
    await sync.sync_weights()


async def resync(sync: Any) -> None:
    """``mark_stale``, then ``sync_weights``: one sync of the trainer's current weights."""
    await sync.mark_stale()
    await sync.sync_weights()


async def sleep_at_level_2(engine: Any, through: Any = None) -> None:
    """A level-2 sleep of the embedded ``engine``: it drops its weights and reports the
    discard. ``finish_generation`` goes to ``through`` (an engine standing in front of
    ``engine``) or to ``engine``; the sleep level is back to 1 after, whatever happens."""
    engine.sleep_level = 2
    try:
        await (engine if through is None else through).finish_generation()
    finally:
        engine.sleep_level = 1


async def sync_catching(
    sync: Any, caught: list[BaseException], kind: type[BaseException] = Exception
) -> None:
    """``sync.sync_weights()``, its error of type ``kind`` appended to ``caught`` (the
    body of a task that runs a sync while the test does something else)."""
    try:
        await sync.sync_weights()
    except kind as exc:
        caught.append(exc)
