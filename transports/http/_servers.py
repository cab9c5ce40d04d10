"""The SGLang servers an HTTP synchronizer refits, and calling them all at once.

:func:`servers_of` finds the servers behind ``generation`` (one, a fleet's engines, or a
list's items) and refuses what is not an :class:`~.server.SGLangServer`, naming what it
lacks; :class:`ServerFanout` calls every server concurrently, naming the one that failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiosync._fanout import each_named
from aiosync.capabilities import engines_of
from aiosync.synchronizer import WeightSynchronizer

from .server import SGLangServer

__all__ = ["ServerFanout", "servers_of"]

_T = TypeVar("_T")


class ServerFanout(WeightSynchronizer):
    """A synchronizer's servers (:attr:`servers`) and the fan-out over them."""

    async def _each(self, call: Callable[[SGLangServer], Awaitable[_T]]) -> list[_T]:
        """``call(server)`` on every server concurrently; results in server order."""
        return await self._each_indexed(lambda _, server: call(server))

    async def _each_indexed(self, call: Callable[[int, SGLangServer], Awaitable[_T]]) -> list[_T]:
        """``call(i, server)`` on every server concurrently; results in server order.

        The first server to fail cancels the others; its error is raised, naming
        the server when there are several (type kept for aiosync's errors).
        """
        return await each_named(self.servers, call, self._label)

    def _label(self, index: int) -> str:
        return f"SGLang server {index} of {len(self.servers)} ({self.servers[index].base_url})"

    @property
    def servers(self) -> tuple[SGLangServer, ...]:
        """The SGLang servers refit, in the fleet's order (one for a single server;
        an elastic fleet's engines in the sync, see :class:`~aiosync.EngineFleet`)."""
        return servers_of(self.generation)


def servers_of(generation: Any) -> tuple[SGLangServer, ...]:
    """The servers behind ``generation`` (itself, a fleet's engines, or a list's items).

    Raises:
        TypeError: one is not an :class:`SGLangServer` (the message names what it lacks).
        ValueError: no server, or the same one twice.
    """
    servers = engines_of(generation, what="SGLang server")
    if len(servers) == 1 and servers[0] is generation and not isinstance(generation, SGLangServer):
        raise TypeError(
            "HTTPWeightSynchronizer drives an SGLang server: pass an SGLangHTTPBackend "
            "(or another SGLangServer), or several in an EngineFleet; "
            f"got {type(generation).__name__}{_lacks(generation)}"
        )
    for i, server in enumerate(servers):
        if not isinstance(server, SGLangServer):
            raise TypeError(
                f"engine {i} of {len(servers)} is not an SGLang server (SGLangServer): "
                f"{type(server).__name__}{_lacks(server)}"
            )
    return servers


def _lacks(obj: Any) -> str:
    members = {*SGLangServer.__annotations__, *vars(SGLangServer)}
    missing = sorted(m for m in members if not m.startswith("_") and not hasattr(obj, m))
    return f", which lacks {', '.join(missing)}" if missing else ""
