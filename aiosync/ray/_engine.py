"""The driver's side of an engine actor: :class:`RayEngine`, an engine whose calls are actor calls.

Every method of the wrapped engine's capabilities (:mod:`aiosync.capabilities`)
is forwarded as one awaited actor call; the properties a synchronizer reads
without awaiting (``asleep_tags``, ``weights_valid``, ``tensor_parallel_size``,
``layout_refusal``) are mirrored from the snapshot every reply carries. A
:class:`RayEngine` claims exactly the capabilities of the engine in its actor
(a method the engine lacks is ``None`` on the class, which is how a
``runtime_checkable`` Protocol is told no), so every transport drives it as
it would drive the engine in-process. Ray's exceptions are translated here, in
one place (:func:`aiosync.ray._remote.remote`). See ``docs/ray.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import anyio
import ray
import ray.exceptions

from aiosync.errors import SyncError, TransportError

from ._claims import base_class, claiming
from ._host import Reply
from ._remote import actor_label, remote

if TYPE_CHECKING:
    from aiosync.capabilities import (
        ConfigReporting,
        DiscardNotifier,
        Engine,
        EngineWorkers,
        Generating,
        HealthReporting,
        InFlightPolicy,
        LayoutReporting,
        ManifestReporting,
        PausableEngine,
        SleepReporting,
        ValidityReporting,
        VersionedEngine,
    )
    from aiosync.engines.fleet import RespawningEngine
    from aiosync.generation import Generation, SamplingParams
    from aiosync.layout import Layout
    from aiosync.lora import LoRAAdapter, LoRAChecking, LoRAEngine

__all__ = [
    "DEFAULT_CALL_GRACE_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "EngineActorInfo",
    "RayEngine",
]

_log = logging.getLogger(__name__)

#: How long past a call's own limit the driver waits for the actor's reply,
#: seconds: the engine in the actor enforces the limit itself; this bounds a
#: hung or frozen actor process.
DEFAULT_CALL_GRACE_S: float = 10.0

#: Limit of a call whose engine names none (no ``rpc_timeout_s``), seconds.
DEFAULT_RPC_TIMEOUT_S: float = 120.0

#: Time allowed for the actor to be scheduled and its engine to start, seconds
#: (as the embedded engine's own start limit).
DEFAULT_START_TIMEOUT_S: float = 600.0


@dataclass(frozen=True, slots=True)
class EngineActorInfo:
    """Who and where an engine actor is, as Ray sees it (from :meth:`RayEngine.start`).

    Attributes:
        actor_id: Ray's actor id (hex).
        node_id: the node it runs on (hex).
        node_ip: that node's IP address, as Ray knows it.
        pid: the actor's process id (on its node).
        resources: what Ray assigned the actor (``{"CPU": 1.0, "GPU": 0.2}``;
            a placement-group bundle's share under Ray's own names).
        engine: the engine's class name.
        capabilities: the capability Protocols the engine satisfies (their names).
        world_size: the engine's worker processes (None: it does not say).
        incarnation: changes whenever the actor's process is replaced (a
            restart by Ray, a relaunch).
    """

    actor_id: str
    node_id: str
    node_ip: str
    pid: int
    resources: Mapping[str, float]
    engine: str
    capabilities: frozenset[str]
    world_size: int | None
    incarnation: str


class RayEngine:
    """An engine living in a Ray actor (:data:`aiosync.ray.EngineActor`), driven from here.

    Construct it on the actor's handle and :meth:`start` it (or ``async with``)
    before handing it to a synchronizer: start builds the engine in the actor
    (once) and learns which capabilities it has; :func:`aiosync.ray.launch_engine`
    does both. The handle may be used from any process of the Ray cluster (a
    trainer actor, the driver).

    What a sync sees is the engine's own behaviour, one actor call away: the
    same capabilities (checked with ``isinstance``), results, versions, and
    errors of the same type and message. In addition:

    * A dead actor (``ray.kill``, a crashed node): the call raises
      :class:`~aiosync.errors.TransportError` (``"... died ..."``, caused by
      Ray's ``RayActorError``) and the weights-discarded listeners run (a
      synchronizer turns stale). :meth:`respawn_dead_workers` heals: it waits
      for an actor Ray restarts (``max_restarts``) or launches a new one (an
      actor :func:`~aiosync.ray.launch_engine` started), starts its engine and
      returns every worker rank; then ``init_communicator()`` and a sync.
    * A hung actor: every call is bounded by its own limit (``timeout_s``, else
      the engine's ``rpc_timeout_s``) plus ``call_grace_s``, then
      :class:`~aiosync.errors.SyncTimeoutError`; a call given up (cancelled,
      timed out) is cancelled in the actor too (``ray.cancel``).

    Args:
        actor: the handle of an :data:`~aiosync.ray.EngineActor`.
        owns_actor: :meth:`shutdown` also kills the actor (``ray.kill``).
        relaunch: ``() -> handle`` creating a replacement actor when this one
            is dead for good (:func:`~aiosync.ray.launch_engine` passes one);
            None: :meth:`respawn_dead_workers` cannot replace a dead actor.
        call_grace_s: see above, seconds.
        start_timeout_s: limit of :meth:`start` (scheduling included), seconds.

    Raises (every forwarded call, besides what the engine raises):
        SyncError: before :meth:`start`, or after :meth:`shutdown`.
        TransportError: the actor died (``__cause__``: Ray's error).
        SyncTimeoutError: no reply within the call's limit plus ``call_grace_s``.
    """

    def __init__(
        self,
        actor: Any,
        *,
        owns_actor: bool = False,
        relaunch: Callable[[], Any] | None = None,
        call_grace_s: float = DEFAULT_CALL_GRACE_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self._actor = actor
        self.owns_actor = owns_actor
        self._relaunch = relaunch
        self.call_grace_s = call_grace_s
        self.start_timeout_s = start_timeout_s
        self._info: EngineActorInfo | None = None
        self._describe: dict[str, Any] = {}
        self._state: dict[str, Any] = {}
        self._discards_seen = 0
        # Set once the actor was seen dead (its weights are gone), until a new one starts.
        self._lost: BaseException | None = None
        self._closed = False
        self._listeners: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        where = "not started" if self._info is None else f"actor {self._info.actor_id[:12]}"
        engine = self._info.engine if self._info is not None else "?"
        return f"RayEngine({engine}, {where})"

    # -- lifecycle --------------------------------------------------------------

    @property
    def actor(self) -> Any:
        """The actor's handle (a new one after :meth:`respawn_dead_workers` relaunched it)."""
        return self._actor

    @property
    def info(self) -> EngineActorInfo:
        """Who and where the actor is (:class:`EngineActorInfo`).

        Raises:
            SyncError: before :meth:`start`.
        """
        if self._info is None:
            raise SyncError("RayEngine.start() first: the actor has not described its engine")
        return self._info

    async def start(self) -> Self:
        """Build the engine in the actor (once) and learn what it can do.

        Idempotent. The first call on a new actor waits for Ray to schedule it
        (bounded by ``start_timeout_s``: an actor whose resources no node has
        stays pending).

        Raises:
            SyncError: the engine was shut down.
            SyncTimeoutError: not started within ``start_timeout_s``.
            TransportError: the actor died while starting.
            Whatever building the engine raises (e.g. a bad config), re-raised here.
        """
        self._check_open()
        if self._info is not None and self._lost is None:
            return self
        await self._start_actor()
        return self

    async def _start_actor(self) -> None:
        description = await remote(
            self, "start", self.start_timeout_s, lambda: self._actor.start.remote()
        )
        self._adopt(description)

    def _adopt(self, description: dict[str, Any]) -> None:
        """Mirror a started actor's description; a new incarnation's weights are not ours."""
        new = self._info is not None and self._info.incarnation != description["incarnation"]
        self._describe = description
        self._info = EngineActorInfo(
            actor_id=str(description["actor_id"]),
            node_id=str(description["node_id"]),
            node_ip=str(description["node_ip"]),
            pid=int(description["pid"]),
            resources=dict(description["resources"]),
            engine=str(description["engine"]),
            capabilities=frozenset(description["capabilities"]),
            world_size=description["world_size"],
            incarnation=str(description["incarnation"]),
        )
        self._discards_seen = int(description["state"]["discards"])
        self._state = dict(description["state"])
        self.__class__ = claiming(
            base_class(type(self)),
            frozenset(description["capabilities"]),
            frozenset(description["methods"]),
        )
        if new and self._lost is None:
            self._notify_discarded()
        self._lost = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down in the actor (its workers exit); kill the actor if
        :attr:`owns_actor` and wait until Ray reports it dead. Idempotent; an actor
        that is already dead is no error."""
        if self._closed:
            return
        self._closed = True
        try:
            await remote(self, "shutdown", timeout_s, lambda: self._actor.shutdown.remote())
        except SyncError:
            pass  # the actor is dead or hung: the kill below ends it
        except Exception:
            # The engine's own shutdown failed: the actor still goes (its children with it).
            _log.exception("shutting down the engine in %s", actor_label(self))
        if not self.owns_actor:
            return
        ray.kill(self._actor)
        # Wait (bounded) for Ray to see it dead: its resources are free from then on.
        with contextlib.suppress(Exception), anyio.move_on_after(timeout_s):
            while True:
                await self._actor.__ray_ready__.remote()
                await anyio.sleep(0.05)

    def _check_open(self) -> None:
        if self._closed:
            raise SyncError("the RayEngine was shut down: launch a new engine actor")

    # -- the one call path --------------------------------------------------------

    def _limit(self, timeout_s: float | None) -> float | None:
        """A call's limit on the driver: its own (or the engine's default) plus grace."""
        if timeout_s is None:
            own = self._describe.get("rpc_timeout_s") or DEFAULT_RPC_TIMEOUT_S
            return float(own) + self.call_grace_s
        if math.isinf(timeout_s):
            return None
        return timeout_s + self.call_grace_s

    async def _call(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        limit_s: float | None,
    ) -> Any:
        """``await engine.method(*args, **kwargs)`` in the actor, within ``limit_s``
        (None: no limit)."""
        self._check_open()
        if self._info is None:
            raise SyncError(f"RayEngine.start() before {method}(): the engine actor is not started")
        reply: Reply = await remote(
            self,
            method,
            limit_s,
            lambda: self._actor.call.remote(method, tuple(args), dict(kwargs or {})),
        )
        outcome, value, state = reply
        self._absorb(state)
        if outcome == "error":
            raise value
        return value

    def _absorb(self, state: dict[str, Any]) -> None:
        """Update the mirror from a reply; run the listeners if the engine discarded weights."""
        if self._info is not None and state.get("incarnation") != self._info.incarnation:
            # A restarted actor answered (its engine is not started): the weights of the
            # one we started are gone; keep its description until respawn_dead_workers().
            self._actor_lost(TransportError("the engine actor was restarted"))
            return
        self._state = dict(state)
        discards = int(state.get("discards", 0))
        if discards > self._discards_seen:
            self._discards_seen = discards
            self._notify_discarded()

    def _actor_lost(self, exc: BaseException) -> None:
        """The actor died: its engine's weights went with it (once per loss)."""
        if self._lost is None:
            self._lost = exc
            self._notify_discarded()

    # -- DiscardNotifier (always: an actor's death discards its weights) -----------

    def _notify_discarded(self) -> None:
        for listener in list(self._listeners):
            listener()

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the engine drops its weights: the engine's own
        discards (a level-2 sleep, a respawned worker), seen when the call that caused
        them returns, and the actor's death or replacement."""
        self._listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- mirrored properties -------------------------------------------------------

    @property
    def world_size(self) -> int | None:
        """The engine's worker processes (its ``world_size``; None: it does not say)."""
        return self._describe.get("world_size")

    @property
    def weight_version(self) -> int | None:
        """The engine's ``weight_version`` as of the last reply (None: none yet)."""
        value = self._state.get("weight_version")
        return None if value is None else int(value)

    @property
    def pids(self) -> list[int]:
        """The engine's worker process ids as of the last reply (on the actor's node)."""
        return list(self._state.get("pids", []))

    @property
    def rpc_timeout_s(self) -> float:
        """The engine's default limit of one call, seconds (``DEFAULT_RPC_TIMEOUT_S``
        if it has none)."""
        return float(self._describe.get("rpc_timeout_s") or DEFAULT_RPC_TIMEOUT_S)

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        """:class:`~aiosync.capabilities.SleepReporting`: what sleeps, as of the last reply."""
        tags = self._state.get("asleep_tags")
        return None if tags is None else frozenset(tags)

    @property
    def weights_valid(self) -> bool:
        """:class:`~aiosync.capabilities.ValidityReporting`, as of the last reply."""
        return bool(self._state.get("weights_valid"))

    @property
    def tensor_parallel_size(self) -> int:
        """:class:`~aiosync.capabilities.LayoutReporting`: the engine's (fixed at start)."""
        return int(self._describe.get("tensor_parallel_size", 1))

    @property
    def layout_refusal(self) -> str | None:
        """:class:`~aiosync.capabilities.LayoutReporting`: the engine's (fixed at start)."""
        refusal = self._describe.get("layout_refusal")
        return None if refusal is None else str(refusal)

    # -- Engine ---------------------------------------------------------------------

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """The engine's ``prepare_for_generation(tags)`` (wake), in the actor."""
        await self._call("prepare_for_generation", (tags,), limit_s=self._limit(None))

    async def finish_generation(self) -> None:
        """The engine's ``finish_generation()`` (sleep), in the actor."""
        await self._call("finish_generation", limit_s=self._limit(None))

    # -- PausableEngine, VersionedEngine -------------------------------------------

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """The engine's ``pause_generation(mode, clear_cache)``; no limit of its own
        (``"wait"`` lasts as long as the longest request: the synchronizer bounds it)."""
        await self._call("pause_generation", (mode, clear_cache), limit_s=None)

    async def resume_generation(self) -> None:
        """The engine's ``resume_generation()``."""
        await self._call("resume_generation", limit_s=self._limit(None))

    async def on_weights_committed(self, version: int) -> None:
        """The engine's ``on_weights_committed(version)``."""
        await self._call("on_weights_committed", (version,), limit_s=self._limit(None))

    # -- EngineWorkers ----------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """The engine's ``collective_rpc``: ``method`` on every worker, one result per
        worker in rank order; bounded by ``timeout_s`` (the engine's default if None)
        plus ``call_grace_s`` on this side."""
        result: list[Any] = await self._call(
            "collective_rpc",
            (method, tuple(args), dict(kwargs or {}), timeout_s),
            limit_s=self._limit(timeout_s),
        )
        return result

    # -- Generating -------------------------------------------------------------------

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """The engine's ``generate_with_meta`` (its :class:`~aiosync.Generation` subclass
        comes back as it is); an engine's ``timeout_s=`` keyword also bounds the call here."""
        limit = self._limit(keywords.get("timeout_s"))
        prompts = [list(p) for p in prompts]
        result: list[Generation] = await self._call(
            "generate_with_meta", (prompts, params), keywords, limit_s=limit
        )
        return result

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **keywords: Any,
    ) -> list[list[int]]:
        """The engine's ``generate``: the new token ids of each prompt, in prompt order."""
        limit = self._limit(keywords.get("timeout_s"))
        prompts = [list(p) for p in prompts]
        result: list[list[int]] = await self._call(
            "generate", (prompts, params), keywords, limit_s=limit
        )
        return result

    # -- checks before a sync -----------------------------------------------------------

    async def expected_manifest(self) -> Mapping[str, tuple[tuple[int, ...], Any]] | None:
        """The engine's ``expected_manifest()``."""
        result: Mapping[str, tuple[tuple[int, ...], Any]] | None = await self._call(
            "expected_manifest", limit_s=self._limit(None)
        )
        return result

    async def expected_config(self) -> Any | None:
        """The engine's ``expected_config()`` (its HF config, pickled across)."""
        return await self._call("expected_config", limit_s=self._limit(None))

    async def weight_layouts(self) -> list[Layout]:
        """The engine's ``weight_layouts()``: one layout per worker, rank order."""
        result: list[Layout] = await self._call("weight_layouts", limit_s=self._limit(None))
        return result

    # -- LoRA ---------------------------------------------------------------------------

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """The engine's ``load_lora_adapter(adapter)`` (the adapter's tensors travel
        in the call)."""
        await self._call("load_lora_adapter", (adapter,), limit_s=self._limit(None))

    async def check_lora_adapter(
        self, config: Mapping[str, Any], target_modules: Sequence[str], max_rank: int
    ) -> None:
        """The engine's ``check_lora_adapter``."""
        await self._call(
            "check_lora_adapter",
            (dict(config), list(target_modules), max_rank),
            limit_s=self._limit(None),
        )

    # -- health ---------------------------------------------------------------------------

    async def check_health(self) -> None:
        """The engine's ``check_health()`` (:class:`~aiosync.capabilities.HealthReporting`):
        returns if it can serve; raises if not, :class:`~aiosync.errors.TransportError`
        when the actor itself is dead."""
        await self._call("check_health", limit_s=self._limit(None))

    # -- respawns -------------------------------------------------------------------------

    async def respawn_dead_workers(self) -> list[int]:
        """Replace what died: the actor itself, or the engine's dead workers.

        * The actor died and Ray restarted it (``max_restarts``): start its engine.
        * The actor is dead for good: launch a replacement (``relaunch``) and start it.
        * Either way the engine is new: the weights-discarded listeners run and
          every worker rank is returned (``range(world_size)``).
        * The actor lives: the engine's own ``respawn_dead_workers()`` (if it has one).

        Then ``init_communicator()`` and a sync, as after any respawn.

        Raises:
            TransportError: the actor is dead and there is no ``relaunch``.
            SyncTimeoutError, and whatever starting the engine raises.
        """
        self._check_open()
        before = self._info.incarnation if self._info is not None else None
        try:
            await self._start_actor()
        except TransportError as dead:
            if self._relaunch is None:
                raise TransportError(
                    f"the engine actor is dead and this RayEngine cannot launch another "
                    f"(no relaunch; launch_engine() gives one): {dead}"
                ) from dead
            with contextlib.suppress(Exception):
                ray.kill(self._actor)
            self._actor = self._relaunch()
            await self._start_actor()
        info = self.info
        if info.incarnation != before:
            return list(range(info.world_size or 0))
        if "respawn_dead_workers" in self._describe.get("methods", ()):
            respawned: list[int] = await self._call(
                "respawn_dead_workers", limit_s=self._limit(None)
            )
            return respawned
        return []

    # -- tests and tools ----------------------------------------------------------------

    async def status(self) -> list[dict[str, Any]]:
        """The engine's ``status()`` (the embedded engine: every worker's)."""
        result: list[dict[str, Any]] = await self._call("status", limit_s=self._limit(None))
        return result

    async def hf_state_dicts(self) -> list[dict[str, Any]]:
        """The engine's ``hf_state_dicts()``: every worker's weights, copied across
        (through Ray's object store: small models, tests and tools)."""
        result: list[dict[str, Any]] = await self._call("hf_state_dicts", limit_s=self._limit(None))
        return result


if TYPE_CHECKING:
    # mypy checks every capability RayEngine can claim (aiosync.capabilities); at
    # run time it claims those of its engine only.
    def _claims(
        e: RayEngine,
    ) -> tuple[
        Engine,
        PausableEngine,
        VersionedEngine,
        DiscardNotifier,
        SleepReporting,
        EngineWorkers,
        Generating,
        ValidityReporting,
        ManifestReporting,
        ConfigReporting,
        LayoutReporting,
        RespawningEngine,
        LoRAEngine,
        LoRAChecking,
        HealthReporting,
    ]:
        return (e, e, e, e, e, e, e, e, e, e, e, e, e, e, e)
