"""Steps several folders' tests take the same way."""

from __future__ import annotations

from typing import Any

__all__ = ["first_sync"]


async def first_sync(sync: Any) -> None:
    """Initialise ``sync`` (``init_communicator``) and run its first sync
    (``mark_stale``, then ``sync_weights``): what a test does before the step it checks."""
    await sync.init_communicator()
    await sync.mark_stale()
    await sync.sync_weights()
