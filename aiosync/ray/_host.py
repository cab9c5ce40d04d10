"""The body of an engine actor: :class:`EngineHost` builds one engine and answers calls on it.

Runs inside the Ray actor's process, on the actor's asyncio event loop (an
async actor: every method is a coroutine, calls run concurrently, as a sync's
receive RPC and its pause do). The engine's own worker processes are the
actor's children. Every reply carries a snapshot of what the driver-side
:class:`~aiosync.ray.RayEngine` mirrors (what sleeps, the discard count, ...),
and an engine's exception travels back as a value, its type kept, so that the
driver raises exactly what an in-process engine would. See ``docs/ray.md``.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
from typing import Any

import ray

from aiosync.capabilities import (
    ConfigReporting,
    DiscardNotifier,
    EngineWorkers,
    Generating,
    HealthReporting,
    LayoutReporting,
    ManifestReporting,
    PausableEngine,
    SleepReporting,
    ValidityReporting,
    VersionedEngine,
)
from aiosync.errors import SyncError, TransportError
from aiosync.lora import LoRAChecking, LoRAEngine

from ._spec import EngineSpec

__all__ = [
    "ALWAYS_METHODS",
    "CAPABILITIES",
    "EXTRA_METHODS",
    "FORWARDED",
    "NOT_STARTED",
    "EngineHost",
    "Reply",
]

_log = logging.getLogger(__name__)

#: Per capability (:mod:`aiosync.capabilities`, :mod:`aiosync.lora`): its Protocol,
#: the methods forwarded to the actor, the properties mirrored on the driver. A
#: :class:`~aiosync.ray.RayEngine` claims exactly the capabilities its engine has.
CAPABILITIES: dict[str, tuple[type, tuple[str, ...], tuple[str, ...]]] = {
    "PausableEngine": (PausableEngine, ("pause_generation", "resume_generation"), ()),
    "VersionedEngine": (VersionedEngine, ("on_weights_committed",), ()),
    "SleepReporting": (SleepReporting, (), ("asleep_tags",)),
    "EngineWorkers": (EngineWorkers, ("collective_rpc",), ()),
    "Generating": (Generating, ("generate_with_meta",), ()),
    "ValidityReporting": (ValidityReporting, (), ("weights_valid",)),
    "ManifestReporting": (ManifestReporting, ("expected_manifest",), ()),
    "ConfigReporting": (ConfigReporting, ("expected_config",), ()),
    "LayoutReporting": (
        LayoutReporting,
        ("weight_layouts",),
        ("tensor_parallel_size", "layout_refusal"),
    ),
    "LoRAEngine": (LoRAEngine, ("load_lora_adapter",), ()),
    "LoRAChecking": (LoRAChecking, ("check_lora_adapter",), ()),
    "HealthReporting": (HealthReporting, ("check_health",), ()),
}


#: Every engine has these (:class:`~aiosync.capabilities.Engine`).
ALWAYS_METHODS: tuple[str, ...] = ("prepare_for_generation", "finish_generation")

#: Forwarded when the engine has them, whatever it claims (the loop's ``generate``,
#: the embedded engine's tools, worker respawns).
EXTRA_METHODS: tuple[str, ...] = (
    "generate",
    "status",
    "hf_state_dicts",
    "respawn_dead_workers",
)

#: Every method name the actor answers; anything else is refused.
FORWARDED: frozenset[str] = frozenset(
    ALWAYS_METHODS + EXTRA_METHODS + tuple(m for _, ms, _ in CAPABILITIES.values() for m in ms)
)

#: Why a call found no engine in the actor.
NOT_STARTED = (
    "the engine actor holds no started engine (Ray restarted the actor, or start() was "
    "never called): await engine.respawn_dead_workers() (or start()), then "
    "init_communicator() and a sync"
)

#: A reply: ``("ok", result, state)`` or ``("error", exception, state)``.
Reply = tuple[str, Any, dict[str, Any]]


class EngineHost:
    """One engine, built from an :class:`EngineSpec` inside a Ray actor.

    Made an actor by :data:`aiosync.ray.EngineActor` (``ray.remote(EngineHost)``);
    the driver talks to it through :class:`~aiosync.ray.RayEngine` only.

    Args:
        spec: what to build (:meth:`start` builds it, once).
    """

    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self._engine: Any = None
        self._closed = False
        # A new token per actor process: a restarted actor (Ray re-ran __init__)
        # has another, which tells the driver the engine's weights are gone.
        self._incarnation = secrets.token_hex(8)
        self._discards = 0

    async def start(self) -> dict[str, Any]:
        """Build and start the engine (once; later calls only describe it).

        Returns:
            :meth:`describe`'s fields.

        Raises:
            SyncError: the engine was shut down.
            Whatever building the engine raises.
        """
        if self._closed:
            raise SyncError("the engine actor's engine was shut down: launch a new actor")
        if self._engine is None:
            engine = await self._spec.build()
            if isinstance(engine, DiscardNotifier):
                engine.add_weights_discarded_listener(self._discarded)
            self._engine = engine
        return self.describe()

    def _discarded(self) -> None:
        self._discards += 1

    def describe(self) -> dict[str, Any]:
        """What the driver mirrors once: who and where this actor is, and what the engine can do."""
        engine = self._engine
        context = ray.get_runtime_context()
        capabilities = sorted(
            name for name, (proto, _, _) in CAPABILITIES.items() if isinstance(engine, proto)
        )
        layout = isinstance(engine, LayoutReporting)
        timeout = getattr(engine, "rpc_timeout_s", None)
        return {
            "incarnation": self._incarnation,
            "actor_id": context.get_actor_id(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "resources": dict(context.get_assigned_resources()),
            "engine": type(engine).__name__,
            "capabilities": capabilities,
            "methods": sorted(m for m in FORWARDED if callable(getattr(engine, m, None))),
            "world_size": _int_or_none(getattr(engine, "world_size", None)),
            "tensor_parallel_size": int(engine.tensor_parallel_size) if layout else 1,
            "layout_refusal": engine.layout_refusal if layout else None,
            "rpc_timeout_s": float(timeout) if isinstance(timeout, int | float) else None,
            "state": self._state(),
        }

    def _state(self) -> dict[str, Any]:
        """What may change with any call: the driver updates its mirror from it."""
        engine = self._engine
        tags = engine.asleep_tags if isinstance(engine, SleepReporting) else None
        return {
            "incarnation": self._incarnation,
            "discards": self._discards,
            "asleep_tags": None if tags is None else sorted(tags),
            "weights_valid": engine.weights_valid
            if isinstance(engine, ValidityReporting)
            else None,
            "weight_version": _int_or_none(getattr(engine, "weight_version", None)),
            "pids": [int(p) for p in getattr(engine, "pids", None) or []],
        }

    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        """``await engine.method(*args, **kwargs)``; the engine's exception is returned,
        not raised (its type kept across the actor boundary).

        A cancelled call (``ray.cancel`` from the driver) cancels the engine's
        call, as cancelling it in-process would.
        """
        engine = self._engine
        try:
            if method not in FORWARDED:
                raise AttributeError(f"{method!r} is not forwarded to engine actors")
            if engine is None:
                if self._closed:
                    raise SyncError("the engine actor's engine was shut down")
                raise TransportError(NOT_STARTED)
            result = await getattr(engine, method)(*args, **kwargs)
        except Exception as exc:
            return ("error", self._portable(exc, method), self._state())
        return ("ok", result, self._state())

    def _portable(self, exc: Exception, method: str) -> Exception:
        """``exc`` if it survives pickling (it must cross to the driver), else a
        TransportError with its type and message; noted with where it was raised."""
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = TransportError(f"{type(exc).__name__}: {exc}")
        _log.debug("engine %s raised %r", method, exc)
        exc.add_note(
            f"raised by {type(self._engine).__name__}.{method} in Ray actor "
            f"{ray.get_runtime_context().get_actor_id()} (pid {os.getpid()})"
        )
        return exc

    async def shutdown(self) -> None:
        """Shut the engine down (its worker processes exit). Idempotent."""
        engine, self._engine, self._closed = self._engine, None, True
        if engine is None:
            return
        if isinstance(engine, DiscardNotifier):
            engine.remove_weights_discarded_listener(self._discarded)
        stop = getattr(engine, "shutdown", None)
        if callable(stop):
            done = stop()
            if hasattr(done, "__await__"):
                await done


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
