"""Small engines for engine actors of the tests (imported in the actor by path)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio


class BareEngine:
    """Only :class:`aiosync.capabilities.Engine` (wake and sleep), and a log of them.

    Waking ``["hang"]`` waits an hour (logged ``"cancelled"`` if cancelled), and its
    ``rpc_timeout_s`` is half a second: a caller's limit is what ends it.
    """

    rpc_timeout_s = 0.5

    def __init__(self) -> None:
        self.log: list[str] = []

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        self.log.append(f"wake {tags}")
        if tags == ["hang"]:
            try:
                await anyio.sleep(3600)
            except anyio.get_cancelled_exc_class():
                self.log.append("cancelled")
                raise

    async def finish_generation(self) -> None:
        self.log.append("sleep")

    async def status(self) -> list[str]:
        return list(self.log)
