"""Engines that stand in front of a real one: a test sees, records or holds what passes.

:class:`RpcForwarder` forwards ``collective_rpc`` to :attr:`~RpcForwarder.engine` and
hands each call's replies to :meth:`~RpcForwarder.replied` (record them, check them,
hang); the class that uses it says what else it forwards. :class:`EngineProxy`
forwards every other attribute too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EngineProxy", "RpcForwarder"]


class RpcForwarder:
    """``collective_rpc`` forwarded to :attr:`engine`, its replies through :meth:`replied`."""

    #: The engine the calls go to.
    engine: Any

    async def collective_rpc(self, method: str, *call: Any, **named: Any) -> list[Any]:
        """The engine's ``collective_rpc(method, *call, **named)``, through :meth:`replied`."""
        replies = await self.engine.collective_rpc(method, *call, **named)
        return await self.replied(method, replies)

    async def replied(self, method: str, replies: list[Any]) -> list[Any]:
        """What the call of ``method`` returns, given the engine's ``replies`` (them)."""
        return replies


class EngineProxy(RpcForwarder):
    """Forwards every attribute it does not define to ``engine``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)
