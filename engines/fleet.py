"""Several engines behind one trainer, synchronized as one: :class:`EngineFleet`.

A fleet is itself a :class:`~aiosync.GenerationBackend` and an
:class:`~aiosync.EngineWorkers`, so every transport drives it unchanged: one
``sync_weights()`` moves the weights to the workers of every engine
concurrently, and ``weight_version`` advances only when all of them committed.

Worker ranks are global: engine ``i``'s workers follow those of engines
``0..i-1`` (each engine's workers are told their offset, see
``aiosync.transports._identity``), as vLLM numbers data-parallel replicas.
An error of one engine is raised with the engine named (``engine 1 of 2: ...``)
and fails the whole sync; every engine that may hold part of the failed
version then refuses to generate until a sync succeeds.
"""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from aiosync._fanout import each_named, named
from aiosync.errors import SyncError, TransportError
from aiosync.generation import Generation
from aiosync.interfaces import IN_FLIGHT_POLICIES, InFlightPolicy
from aiosync.lora import LoRAAdapter

__all__ = ["EngineFleet"]

_T = TypeVar("_T")


class EngineFleet:
    """Several engines (vLLM replicas, embedded engines) updated by one synchronizer.

    Args:
        engines: the engines (one is allowed); each a :class:`~aiosync.GenerationBackend`,
            and an :class:`~aiosync.EngineWorkers` (``collective_rpc``) for the
            IPC and collective transports. Order fixes the worker ranks.

    Raises:
        ValueError: no engine, or the same engine twice.
    """

    def __init__(self, engines: Sequence[Any]) -> None:
        engines = list(engines)
        if not engines:
            raise ValueError("an engine fleet needs at least one engine")
        if len({id(e) for e in engines}) != len(engines):
            raise ValueError("an engine appears twice in the fleet")
        self.engines: list[Any] = engines
        #: Each engine's first global worker rank, once assigned.
        self._offsets: list[int] | None = None
        self._num_workers = 0
        self._assigning = anyio.Lock()
        # Why generate() refuses on account of a LoRA adapter load across the fleet.
        self._lora_refusal: str | None = None
        # A member engine that replaces a worker (its own ``respawn_dead_workers``)
        # reports the discarded weights: the new worker lacks its rank offset, so
        # the ranks are assigned again on the next collective_rpc.
        for engine in engines:
            add = getattr(engine, "add_weights_discarded_listener", None)
            if add is not None:
                add(self._forget_ranks)

    def __len__(self) -> int:
        return len(self.engines)

    def __repr__(self) -> str:
        return f"EngineFleet({', '.join(type(e).__name__ for e in self.engines)})"

    # -- fan-out ---------------------------------------------------------------

    async def _on_each(self, call: Callable[[int, Any], Awaitable[_T]]) -> list[_T]:
        """``call(i, engine)`` on every engine concurrently; results in engine order.
        The first engine to fail cancels the others; its error names the engine."""
        return await each_named(self.engines, call, self._label)

    def _label(self, index: int) -> str:
        return f"engine {index} of {len(self.engines)} ({type(self.engines[index]).__name__})"

    # -- EngineWorkers ---------------------------------------------------------

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
                if not hasattr(engine, "collective_rpc"):
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
        offsets = self._offsets  # the engines' respawns reset it (see __init__)
        for i, engine in enumerate(self.engines):
            respawn = getattr(engine, "respawn_dead_workers", None)
            if respawn is None:
                continue
            local = await respawn()
            if local:
                base = offsets[i] if offsets is not None else 0
                respawned.extend(base + r for r in local)
        if respawned:
            self._offsets = None
        return respawned

    # -- GenerationBackend -----------------------------------------------------

    async def on_weights_committed(self, version: int) -> None:
        """Tell every engine that reports weight versions that ``version`` landed."""

        async def report(i: int, engine: Any) -> None:
            committed = getattr(engine, "on_weights_committed", None)
            if committed is not None:
                await committed(version)

        await self._on_each(report)

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Pause generation on every engine that can (``pause_generation``), concurrently.

        Returns once every engine's pause returned (see
        :class:`~aiosync.GenerationBackend`: ``"abort"``, ``"wait"``, ``"keep"``).
        An engine that failed to pause cancels the others' pauses; the
        synchronizer then resumes the whole fleet.

        Raises:
            ValueError: an unknown ``mode`` (before any engine is told).
            Whatever an engine's ``pause_generation`` raises, naming the engine.
        """
        if mode not in IN_FLIGHT_POLICIES:
            raise ValueError(f"mode must be one of {IN_FLIGHT_POLICIES}, got {mode!r}")

        async def pause(i: int, engine: Any) -> None:
            method = getattr(engine, "pause_generation", None)
            if method is not None:
                await method(mode, clear_cache=clear_cache)

        await self._on_each(pause)

    async def resume_generation(self) -> None:
        """Resume generation on every engine that can (``resume_generation``).

        Every engine is resumed even if another's resume fails; the first error
        is raised then, naming its engine.
        """

        async def resume(i: int, engine: Any) -> None:
            method = getattr(engine, "resume_generation", None)
            if method is not None:
                await method()

        await each_named(self.engines, resume, self._label, settle=True)

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        """What sleeps on any engine (the union of their ``asleep_tags``); None when
        an engine does not say (a colocated synchronizer then wakes every time)."""
        union: set[str] = set()
        for engine in self.engines:
            tags = getattr(engine, "asleep_tags", None)
            if tags is None:
                return None
            union |= set(tags)
        return frozenset(union)

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``tags`` (None: all) on every engine, concurrently."""
        await self._on_each(lambda i, e: e.prepare_for_generation(tags=tags))

    async def finish_generation(self) -> None:
        """Let every engine sleep, concurrently."""
        await self._on_each(lambda i, e: e.finish_generation())

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Register ``listener`` with every engine that reports discarded weights."""
        for engine in self.engines:
            add = getattr(engine, "add_weights_discarded_listener", None)
            if add is not None:
                add(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener`."""
        for engine in self.engines:
            remove = getattr(engine, "remove_weights_discarded_listener", None)
            if remove is not None:
                remove(listener)

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Load ``adapter`` into every engine concurrently (each ``load_lora_adapter``).

        The first engine to fail cancels the others and its error is raised,
        naming it. From the call until it returns, and after it failed,
        :meth:`generate` refuses until a load succeeds on every engine: engines
        that did load the adapter are not used while others may not have it.

        Raises:
            TypeError: an engine has no ``load_lora_adapter`` (before any load).
            Whatever an engine's ``load_lora_adapter`` raises, naming the engine.
        """
        for i, engine in enumerate(self.engines):
            if not callable(getattr(engine, "load_lora_adapter", None)):
                raise TypeError(f"{self._label(i)} has no load_lora_adapter(adapter)")
        self._lora_refusal = f"loading LoRA adapter {adapter.name!r} did not complete everywhere"
        await self._on_each(lambda i, e: e.load_lora_adapter(adapter))
        self._lora_refusal = None

    async def generate(self, prompts: Sequence[Sequence[int]], **options: Any) -> list[list[int]]:
        """Split ``prompts`` over the engines (data parallel); results in prompt order.

        Engine ``i`` of ``n`` gets prompts ``i, i + n, ...``; ``options`` (sampling
        parameters) go to every engine's ``generate``.

        Raises:
            SyncError: a fleet-wide LoRA adapter load (:meth:`load_lora_adapter`)
                is in flight or failed.
            Whatever an engine's ``generate`` raises (e.g. :class:`~aiosync.SyncError`
            while its weights are not valid), naming the engine.
        """
        if self._lora_refusal is not None:
            raise SyncError(
                f"the engine fleet refuses to generate: {self._lora_refusal}; a sync must "
                "succeed first"
            )
        n = len(self.engines)
        parts = [list(prompts[i::n]) for i in range(n)]

        async def run(i: int, engine: Any) -> list[list[int]]:
            if not parts[i]:
                return []
            out: list[list[int]] = await engine.generate(parts[i], **options)
            return out

        outs = await self._on_each(run)
        merged: list[list[int]] = [[] for _ in prompts]
        for i, out in enumerate(outs):
            merged[i::n] = out
        return merged

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
    ) -> list[Generation]:
        """:meth:`generate` through every engine's ``generate_with_meta``: one
        :class:`aiosync.Generation` per prompt, in prompt order (of the engine's
        own subclass, e.g. :class:`~aiosync.engines.embedded.engine.EmbeddedGeneration`).

        The keywords are :class:`aiosync.GenerationBackend`'s, passed to every
        engine unchanged (so ``seed`` seeds each engine's share alike).

        Raises:
            TypeError: an engine has no ``generate_with_meta`` (before any generation).
            SyncError: as :meth:`generate`.
            Whatever an engine's ``generate_with_meta`` raises, naming the engine.
        """
        for i, engine in enumerate(self.engines):
            if not callable(getattr(engine, "generate_with_meta", None)):
                raise TypeError(f"{self._label(i)} has no generate_with_meta")
        if self._lora_refusal is not None:
            raise SyncError(
                f"the engine fleet refuses to generate: {self._lora_refusal}; a sync must "
                "succeed first"
            )
        n = len(self.engines)
        parts = [list(prompts[i::n]) for i in range(n)]

        async def run(i: int, engine: Any) -> list[Generation]:
            if not parts[i]:
                return []
            out: list[Generation] = await engine.generate_with_meta(
                parts[i],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
            )
            return out

        outs = await self._on_each(run)
        merged: list[Generation | None] = [None] * len(prompts)
        for i, out in enumerate(outs):
            merged[i::n] = out
        return [g for g in merged if g is not None]

    # -- tests and tools -------------------------------------------------------

    async def hf_state_dicts(self) -> list[Any]:
        """Every worker's weights, global rank order (engines that offer it)."""
        outs = await self._on_each(lambda i, e: e.hf_state_dicts())
        return [state for out in outs for state in out]

    async def status(self) -> list[dict[str, Any]]:
        """Every worker's status, global rank order (engines that offer it)."""
        outs = await self._on_each(lambda i, e: e.status())
        return [s for out in outs for s in out]
