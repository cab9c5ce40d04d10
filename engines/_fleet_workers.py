"""An :class:`~aiosync.EngineFleet`'s workers as one set: global ranks and the RPC fan-out.

Worker ranks are global: engine ``i``'s workers follow those of engines
``0..i-1`` (each engine's workers are told their offset, see
``aiosync.transports._identity``), as vLLM numbers data-parallel replicas. The
offsets are assigned on the first :meth:`~_FleetWorkers.collective_rpc` after each
membership change, after a member discarded its weights and after a respawn (a new
worker lacks its offset). An error of one engine is raised with the engine named
(``engine 1 of 2: ...``).
"""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio

from aiosync._fanout import each_named, named
from aiosync.capabilities import EngineWorkers
from aiosync.errors import TransportError

from ._catch_up import _PeerCatchUp

__all__ = ["RespawningEngine"]

_T = TypeVar("_T")


@runtime_checkable
class RespawningEngine(Protocol):
    """An engine that can replace its dead worker processes (the embedded engine)."""

    async def respawn_dead_workers(self) -> list[int]:
        """Start a fresh worker for every dead one; returns their ranks (ascending)."""
        ...


class _FleetWorkers(_PeerCatchUp):
    """Every worker of every engine a sync reaches, in global rank order (the module
    docs): :class:`~aiosync.EngineWorkers`, ``WorkerDescribing``, :class:`RespawningEngine`."""

    def _init_workers(self) -> None:
        #: Each engine's first global worker rank, once assigned.
        self._offsets: list[int] | None = None
        self._num_workers = 0
        self._assigning = anyio.Lock()

    # -- fan-out -----------------------------------------------------------------------

    async def _on_each(self, call: Callable[[int, Any], Awaitable[_T]]) -> list[_T]:
        """``call(i, engine)`` on every engine concurrently; results in engine order.
        The first engine to fail cancels the others; its error names the engine."""
        return await each_named(self.engines, call, self._label)

    def _label(self, index: int) -> str:
        """The label of ``self.engines[index]`` (its place among all members)."""
        return self._name(self.engines[index])

    # -- EngineWorkers -----------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker of every engine; one result per worker,
        in global rank order (engine 0's workers first).

        Raises:
            TransportError: an engine has no ``collective_rpc``, or the workers'
                ranks are not unique across the fleet.
            Whatever an engine's ``collective_rpc`` raises, naming the engine.
        """
        await self._assign_ranks(timeout_s)

        async def rpc(i: int, engine: Any) -> list[Any]:
            replies: list[Any] = await engine.collective_rpc(
                method, args, kwargs, timeout_s=timeout_s
            )
            # aiosync's worker RPCs answer failures as {"ok": False, "type", "message"}:
            # name the engine there too, since the trainer raises from that reply.
            for reply in replies:
                if isinstance(reply, dict) and reply.get("ok") is False:
                    reply["message"] = f"{self._label(i)}: {reply.get('message', '')}"
            return replies

        return [reply for replies in await self._on_each(rpc) for reply in replies]

    async def _assign_ranks(self, timeout_s: float | None) -> None:
        if self._offsets is not None:
            return
        async with self._assigning:
            if self._offsets is not None:
                return
            for i, engine in enumerate(self.engines):
                if not isinstance(engine, EngineWorkers):
                    raise TransportError(
                        f"engine {i} ({type(engine).__name__}) has no collective_rpc"
                    )
            offsets: list[int] = []
            ranks: list[int] = []
            # One engine after the other: an engine's offset is the worker count before it.
            for i, engine in enumerate(self.engines):
                offsets.append(len(ranks))
                try:
                    got = await engine.collective_rpc(
                        "aiosync_set_rank_offset", (offsets[-1],), timeout_s=timeout_s
                    )
                except Exception as exc:
                    raise named(exc, self._label(i)) from None
                ranks.extend(int(r) for r in got)
            if sorted(ranks) != list(range(len(ranks))):
                raise TransportError(
                    f"worker ranks across the fleet are not 0..{len(ranks) - 1}: {ranks}"
                )
            self._offsets = offsets
            self._num_workers = len(ranks)

    def _forget_ranks(self) -> None:
        self._offsets = None

    def locate(self, rank: int) -> tuple[int, int]:
        """``(engine index, worker rank within that engine)`` of a global worker rank.

        Raises:
            ValueError: before the first ``collective_rpc`` (ranks are not assigned
                yet), or no worker has ``rank``.
        """
        if self._offsets is None:
            raise ValueError("worker ranks are assigned on the fleet's first collective_rpc")
        if 0 <= rank < self._num_workers:
            index = bisect.bisect_right(self._offsets, rank) - 1
            return index, rank - self._offsets[index]
        raise ValueError(f"no worker has rank {rank} (the fleet has {self._num_workers})")

    def describe_worker(self, rank: int) -> str:
        """``"engine i of n (Type): engine worker rank"`` for global worker ``rank``
        (just ``"engine worker rank"`` when no engine holds it): the prefix of an
        error that a worker reports itself."""
        try:
            index, _local = self.locate(rank)
        except ValueError:
            return f"engine worker {rank}"
        return f"{self._label(index)}: engine worker {rank}"

    async def respawn_dead_workers(self) -> list[int]:
        """Replace dead workers of every engine that can (the embedded engine);
        returns their global ranks. New workers learn their rank offset again
        on the next :meth:`collective_rpc` (as when a member engine respawns its
        own workers)."""
        respawned: list[int] = []
        offsets = self._offsets  # the engines' respawns reset it (see the fleet's _discarded)
        for i, engine in enumerate(self.engines):
            if not isinstance(engine, RespawningEngine):
                continue
            local = await engine.respawn_dead_workers()
            if local:
                base = offsets[i] if offsets is not None else 0
                respawned.extend(base + r for r in local)
        if respawned:
            self._offsets = None
        return respawned
