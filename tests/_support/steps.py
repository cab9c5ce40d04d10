"""Steps several folders' tests take the same way."""

from __future__ import annotations

from typing import Any

__all__ = ["first_sync", "sleep_at_level_2"]


async def first_sync(sync: Any) -> None:
    """Initialise ``sync`` (``init_communicator``) and run its first sync
    (``mark_stale``, then ``sync_weights``): what a test does before the step it checks."""
    await sync.init_communicator()
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
