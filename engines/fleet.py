"""Several engines behind one trainer, synchronized as one: :class:`EngineFleet`.

A fleet is itself a :class:`~aiosync.GenerationBackend` and an
:class:`~aiosync.EngineWorkers`, so every transport drives it unchanged: one
``sync_weights()`` moves the weights to the workers of every engine
concurrently, and ``weight_version`` advances only when all of them committed.
An error of one engine is raised with the engine named (``engine 1 of 2: ...``)
and fails the whole sync; every engine that may hold part of the failed
version then refuses to generate until a sync succeeds.

The class is built by role, one module each, every layer on the one before:

* :mod:`._membership`: the members, in service, joining, quarantined, and the
  quarantine after a failed sync (**elastic fleets**, ``on_engine_failure="quarantine"``);
* :mod:`._waves`: **rolling refits** (``refit="rolling"``): the waves, and the
  version each engine serves (``max_version_lag``);
* :mod:`._catch_up`: engines added from the trainer or from a peer (**catch-up from
  a peer**, :meth:`EngineFleet.catch_up`), and the gate between syncs and catch-ups;
* :mod:`._fleet_workers`: the workers of every engine as one set (global ranks,
  ``collective_rpc``);
* this module: the fleet as one engine (commit, pause, sleep, generation, LoRA,
  layouts), each call fanned out to the engines.

Worker ranks are global: engine ``i``'s workers follow those of engines
``0..i-1``, as vLLM numbers data-parallel replicas. See each module's docs, and
``docs/fleets.md``.

Capabilities (:mod:`aiosync.capabilities`) when some members lack one: what a
member can skip without lying the fleet forwards to the members that have it
(:class:`~aiosync.capabilities.PausableEngine`, ``VersionedEngine``,
``DiscardNotifier``, :class:`RespawningEngine`: a member without them has no
requests to hold, no label, nothing it discards, no workers it replaces);
``SleepReporting`` answers None (unknown: wake everything) unless every member
reports; ``EngineWorkers``, ``Generating`` and ``load_lora_adapter`` need every
member (an error naming the member that lacks it, before any member is called).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, cast

import anyio

from aiosync._fanout import each_named, named
from aiosync.capabilities import (
    IN_FLIGHT_POLICIES,
    DiscardNotifier,
    EngineWorkers,
    Generating,
    HealthReporting,
    InFlightPolicy,
    LayoutReporting,
    PausableEngine,
    SleepReporting,
    VersionedEngine,
)
from aiosync.errors import SyncError, TransportError
from aiosync.generation import Generation, SamplingParams, sampling_params
from aiosync.lora import LoRAAdapter, LoRAEngine

from ._catch_up import CatchUp
from ._fleet_workers import RespawningEngine, _FleetWorkers
from ._generate import GenerateFromMeta
from ._membership import OnEngineFailure
from ._waves import FleetRefit, JoinSource

if TYPE_CHECKING:
    from aiosync.capabilities import (
        ElasticEngines,
        Engine,
        EngineSet,
        RollingEngines,
        WorkerDescribing,
    )
    from aiosync.layout import Layout

__all__ = [
    "CatchUp",
    "EngineFleet",
    "FleetRefit",
    "JoinSource",
    "LoRAEngine",
    "OnEngineFailure",
    "RespawningEngine",
]

#: The keywords of generate_with_meta that are sampling parameters (the rest
#: are an engine's own, e.g. the embedded engine's ``timeout_s``).
_SAMPLING_KEYWORDS = frozenset(f.name for f in fields(SamplingParams)) | {"max_new_tokens"}


class EngineFleet(_FleetWorkers, GenerateFromMeta):
    """Several engines (vLLM replicas, embedded engines) updated by one synchronizer.

    Args:
        engines: the engines (one is allowed); each a :class:`~aiosync.GenerationBackend`,
            and an :class:`~aiosync.EngineWorkers` (``collective_rpc``) for the
            IPC and collective transports. Order fixes the worker ranks.
        on_engine_failure: ``"fail"`` (one failing engine fails the sync) or
            ``"quarantine"`` (see the module docs).
        min_engines: with ``"quarantine"``, the fewest engines in service a sync
            may commit on (>= 1).
        probe_timeout_s: limit of the probe of one engine after a failed sync (its
            health check and a round trip to every worker), seconds; an engine
            that does not answer within it is set aside as hung.
        refit: ``"all"`` (every engine paused for each sync) or ``"rolling"``
            (waves; see the module docs). A synchronizer whose transport cannot
            address part of the fleet refuses a rolling fleet at construction.
        max_unavailable: with ``"rolling"``, the most engines in service refit at
            once: an int >= 1, or a fraction in (0, 1) of the engines in service
            (at least 1).
        wave_source: with ``"rolling"``, where waves after the first take the new
            version from: the trainer (``"trainer"``) or an engine of an earlier wave
            (``"peer"``: :meth:`copy_wave`, worker to worker, verified against the
            peer's digests), so that the trainer sends one copy per sync whatever the
            fleet's size (not with ``delta=True`` or ``kv_scales``).
        max_version_lag: the most versions an engine in service may be behind the
            newest one in service and still take new requests; None: no bound.
            An engine that never committed a version (its initial weights) counts
            as unknown, never behind.

    Raises:
        ValueError: no engine, the same engine twice, an unknown
            ``on_engine_failure`` or ``refit``, ``min_engines`` < 1,
            ``max_unavailable`` not an int >= 1 nor a fraction in (0, 1), or
            ``max_version_lag`` < 0.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        on_engine_failure: OnEngineFailure = "fail",
        min_engines: int = 1,
        probe_timeout_s: float = 10.0,
        refit: FleetRefit = "all",
        max_unavailable: int | float = 1,
        max_version_lag: int | None = None,
        wave_source: JoinSource = "trainer",
    ) -> None:
        # Each layer's own state, its arguments checked there (the module docs).
        self._init_membership(engines, on_engine_failure, min_engines, probe_timeout_s)
        self._init_waves(refit, max_unavailable, max_version_lag, wave_source)
        self._init_catch_up()
        self._init_workers()
        self._listeners: list[Callable[[], None]] = []
        # Why generate() refuses on account of a LoRA adapter load across the fleet.
        self._lora_refusal: str | None = None
        for engine in self.members:
            self._relay_discards(engine)

    def __len__(self) -> int:
        return len(self.engines)

    def __repr__(self) -> str:
        return f"EngineFleet({', '.join(type(e).__name__ for e in self.engines)})"

    # -- health (HealthReporting) ------------------------------------------------

    async def check_health(self) -> None:
        """Check every engine in the sync that can tell
        (:class:`~aiosync.capabilities.HealthReporting`), concurrently; the others
        count as healthy.

        Raises:
            Whatever the first failing engine's ``check_health`` raised (e.g.
            :class:`~aiosync.errors.TransportError` naming its dead worker), naming
            the engine.
        """

        async def check(i: int, engine: Any) -> None:
            if isinstance(engine, HealthReporting):
                await engine.check_health()

        await self._on_each(check)

    async def _unhealthy(self, engines: Sequence[Any]) -> Exception | None:
        """The first of ``engines`` to fail its health check (bounded by
        ``probe_timeout_s``), its error naming it; None: none failed."""
        for engine in engines:
            if not isinstance(engine, HealthReporting):
                continue
            try:
                with anyio.fail_after(self.probe_timeout_s):
                    await engine.check_health()
            except TimeoutError:
                continue
            except Exception as exc:
                return cast("Exception", named(exc, self._name(engine)))
        return None

    # -- GenerationBackend -----------------------------------------------------

    async def on_weights_committed(self, version: int) -> None:
        """Tell every engine that reports weight versions that ``version`` landed."""

        async def report(i: int, engine: Any) -> None:
            if isinstance(engine, VersionedEngine):
                await engine.on_weights_committed(version)

        await self._on_each(report)
        committed = self.engines
        for engine in committed:
            self._serves(engine, version)
        # The joining engines received this version whole: they serve from now on.
        joining = [e for e in committed if id(e) in self._joining]
        self._joining.difference_update(id(e) for e in joining)
        self._joined.extend(self._name(e) for e in joining)

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
            if isinstance(engine, PausableEngine):
                await engine.pause_generation(mode, clear_cache=clear_cache)

        # A sync pauses before it writes: it waits here while a catch-up copies from or
        # into one of its engines, and a catch-up waits for it to resume them.
        await self._refit_begins()
        await self._on_each(pause)

    async def resume_generation(self) -> None:
        """Resume generation on every engine that can (``resume_generation``).

        Every engine is resumed even if another's resume fails; the first error
        is raised then, naming its engine.
        """

        async def resume(i: int, engine: Any) -> None:
            if isinstance(engine, PausableEngine):
                await engine.resume_generation()

        try:
            await each_named(self.engines, resume, self._label, settle=True)
        finally:
            await self._refit_ends()

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        """What sleeps on any engine (the union of their ``asleep_tags``); None when
        an engine does not say (a colocated synchronizer then wakes every time)."""
        union: set[str] = set()
        for engine in self.engines:
            tags = engine.asleep_tags if isinstance(engine, SleepReporting) else None
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
        """Call ``listener()`` whenever an engine that reports discarded weights (one
        in the fleet now or added later) drops them, unless it is quarantined
        (:meth:`_discarded`)."""
        self._listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener`."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _relay_discards(self, engine: Any) -> None:
        """Hear ``engine``'s discard notices (once per member, for good)."""
        if isinstance(engine, DiscardNotifier):
            engine.add_weights_discarded_listener(functools.partial(self._discarded, engine))

    def _discarded(self, engine: Any) -> None:
        """Member ``engine`` dropped its weights (a level-2 sleep, a respawned worker,
        its actor's death): the ranks are assigned again on the next
        :meth:`collective_rpc` (a new worker lacks its offset), and the fleet's
        listeners (its synchronizer) are told.

        A quarantined engine's notice is dropped: no sync reaches it and it serves
        nothing, so its weights are no one's, and its death seen late or the
        respawn that heals it must neither fail the sync that set it aside nor
        make the engines in service stale (case C36)."""
        if id(engine) in self._quarantined or id(engine) in self._catching_up:
            return
        self._versions.pop(id(engine), None)
        self._forget_ranks()
        for listener in list(self._listeners):
            listener()

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
            if not isinstance(engine, LoRAEngine):
                raise TypeError(f"{self._label(i)} has no load_lora_adapter(adapter)")
        self._lora_refusal = f"loading LoRA adapter {adapter.name!r} did not complete everywhere"
        await self._on_each(lambda i, e: e.load_lora_adapter(adapter))
        self._lora_refusal = None

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """Split ``prompts`` over the engines (data parallel): one
        :class:`aiosync.Generation` per prompt, in prompt order (of the engine's
        own subclass, e.g. :class:`~aiosync.engines.embedded.engine.EmbeddedGeneration`).
        :meth:`generate` returns their ``token_ids``.

        Engine ``i`` of ``n`` gets prompts ``i, i + n, ...``. ``params`` and the
        sampling keywords (:func:`aiosync.generation.sampling_params`) are resolved
        here, once, and passed to every engine as one
        :class:`~aiosync.SamplingParams` (so ``seed`` seeds each engine's share
        alike); other keywords (an engine's own, e.g. ``timeout_s``) go to every
        engine unchanged.

        Raises:
            TypeError: an engine has no ``generate_with_meta``; an unknown
                sampling keyword or no token limit (before any generation).
            ValueError: bad sampling parameters (before any generation).
            SyncError: a fleet-wide LoRA adapter load (:meth:`load_lora_adapter`)
                is in flight or failed.
            Whatever an engine's ``generate_with_meta`` raises (e.g.
            :class:`~aiosync.SyncError` while its weights are not valid), naming the engine.
        """
        serving = self.serving
        for engine in serving:
            if not isinstance(engine, Generating):
                raise TypeError(f"{self._name(engine)} has no generate_with_meta")
        sampling = sampling_params(
            params, {k: v for k, v in keywords.items() if k in _SAMPLING_KEYWORDS}
        )
        extras = {k: v for k, v in keywords.items() if k not in _SAMPLING_KEYWORDS}
        if self._lora_refusal is not None:
            raise SyncError(
                f"the engine fleet refuses to generate: {self._lora_refusal}; a sync must "
                "succeed first"
            )
        if not serving:
            raise SyncError(
                "the engine fleet has no engine in service (a joining engine serves once "
                f"its first sync committed; quarantined: {self.quarantined})"
            )
        n = len(serving)
        parts = [list(prompts[i::n]) for i in range(n)]

        async def run(i: int, engine: Any) -> list[Generation]:
            if not parts[i]:
                return []
            out: list[Generation] = await engine.generate_with_meta(parts[i], sampling, **extras)
            return out

        try:
            outs = await each_named(serving, run, lambda i: self._name(serving[i]))
        except Exception as exc:
            # A member's dead worker is the cause the others' refusals (weights left
            # invalid by the sync it failed) only echo: name it.
            dead = await self._unhealthy(serving)
            if dead is not None:
                raise dead from exc
            raise
        merged: list[Generation | None] = [None] * len(prompts)
        for i, out in enumerate(outs):
            merged[i::n] = out
        return [g for g in merged if g is not None]

    # -- LayoutReporting -------------------------------------------------------

    @property
    def tensor_parallel_size(self) -> int:
        """The largest member's (1 when no member splits its weights): the fleet
        holds slices somewhere when it is above 1."""
        return max(
            (e.tensor_parallel_size for e in self.engines if isinstance(e, LayoutReporting)),
            default=1,
        )

    @property
    def layout_refusal(self) -> str | None:
        """The first member's reason not to report a layout, naming it (None: none)."""
        for i, engine in enumerate(self.engines):
            if not isinstance(engine, LayoutReporting):
                return f"{self._label(i)} does not report its weight layout"
            if engine.layout_refusal is not None:
                return f"{self._label(i)}: {engine.layout_refusal}"
        return None

    async def weight_layouts(self) -> list[Layout]:
        """Every worker's layout, global rank order (engine 0's workers first).

        Raises:
            TransportError: a member does not report its layout (named, before any
                member is called).
        """
        for i, engine in enumerate(self.engines):
            if not isinstance(engine, LayoutReporting):
                raise TransportError(f"{self._label(i)} does not report its weight layout")
        await self._assign_ranks(None)
        outs = await self._on_each(lambda i, e: e.weight_layouts())
        return [layout for out in outs for layout in out]

    # -- tests and tools -------------------------------------------------------

    async def hf_state_dicts(self) -> list[Any]:
        """Every worker's weights, global rank order (engines that offer it)."""
        outs = await self._on_each(lambda i, e: e.hf_state_dicts())
        return [state for out in outs for state in out]

    async def status(self) -> list[dict[str, Any]]:
        """Every worker's status, global rank order (engines that offer it)."""
        outs = await self._on_each(lambda i, e: e.status())
        return [s for out in outs for s in out]


if TYPE_CHECKING:
    # mypy checks the capabilities the fleet claims (aiosync.capabilities).
    def _claims(
        f: EngineFleet,
    ) -> tuple[
        Engine,
        PausableEngine,
        VersionedEngine,
        DiscardNotifier,
        SleepReporting,
        EngineWorkers,
        WorkerDescribing,
        Generating,
        LayoutReporting,
        EngineSet,
        RespawningEngine,
        LoRAEngine,
        ElasticEngines,
        HealthReporting,
        RollingEngines,
    ]:
        return (f, f, f, f, f, f, f, f, f, f, f, f, f, f, f)
