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

**Elastic fleets** (``on_engine_failure="quarantine"``). After a failed sync the
synchronizer asks the fleet which members failed (:meth:`EngineFleet.set_aside_failed`):
each engine in the sync is probed (its :class:`~aiosync.capabilities.HealthReporting`
check, then one round trip to every worker, within ``probe_timeout_s``: a hung
worker fails it as a dead one does); the ones that fail are *quarantined*: no more
syncs, no generate calls. If at least ``min_engines`` remain, the synchronizer re-forms
its transport over them and syncs them again within the same ``sync_weights()``
(``weight_version`` then means "live on every engine in service"); below it the
sync fails as with ``"fail"``. :meth:`EngineFleet.add_engine` (a new engine, or a
healed one) brings an engine in as *joining*: the next sync gives it every
tensor, and it serves only once that sync committed. Worker ranks stay
contiguous over the engines in the sync; each membership change bumps
:attr:`EngineFleet.membership_epoch`, which makes the synchronizer re-initialize
before its next transfer.

**Rolling refits** (``refit="rolling"``). One ``sync_weights()`` refits the fleet in
*waves* of at most ``max_unavailable`` engines (:meth:`EngineFleet.waves`): the
synchronizer narrows the fleet to a wave (:meth:`EngineFleet.begin_wave`: syncs reach
only its engines, and the transport re-forms over them), pauses, transfers, labels
and resumes them, then goes on to the next; meanwhile ``generate`` goes to the
engines outside the wave, which serve the version they hold, and each
:class:`~aiosync.Generation` says which version computed it. ``weight_version``
advances once every wave committed. A wave that fails (or is cancelled) leaves its
engines *unfit*: they serve nothing until a later sync commits them; the waves
before it serve the new version, those after it the previous one
(:attr:`EngineFleet.versions`), so the fleet keeps generating through a failed refit.
``max_version_lag`` bounds the mix: an engine more versions behind the newest one in
service takes no new requests until it catches up. Engines joining or unfit go in the
first wave (they serve nothing, so refitting them costs no capacity). Each wave
re-forms the transport (the collective: a group over the wave's workers), so a wave
costs one formation besides its transfer.

**Catch-up from a peer** (``add_engine(engine, source="peer")``, then
:meth:`EngineFleet.catch_up`). The engine takes the weights of the newest version the
fleet serves from an engine that serves it, worker to worker, instead of from the
trainer: no sync reaches it while it waits, the trainer's source is not read and the
synchronizer sends nothing for it. Its weights are invalid from the first byte
received; it serves, labelled with the peer's version, only once the digests of every
tensor it holds equal the peer's. A sync waits (in :meth:`EngineFleet.pause_generation`)
before it refits an engine being copied from or into; a catch-up waits for a sync that is
refitting its peer. See ``docs/fleets.md`` ("Catch-up from a peer").

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

import bisect
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast, runtime_checkable

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
    engines_of,
)
from aiosync.errors import SyncError, SyncTimeoutError, TransportError
from aiosync.generation import Generation, SamplingParams, sampling_params
from aiosync.lora import LoRAAdapter, LoRAEngine

from ._generate import GenerateFromMeta
from ._peer import CatchUp, copy_weights

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

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

#: What a fleet does with an engine that fails a sync: fail the sync (``"fail"``), or
#: set the engine aside and commit on the others (``"quarantine"``).
OnEngineFailure = Literal["fail", "quarantine"]

#: How one ``sync_weights()`` refits a fleet: every engine at once (``"all"``: each is
#: paused for the transfer), or in waves while the others serve (``"rolling"``).
FleetRefit = Literal["all", "rolling"]

#: Where an engine added to a fleet takes its first weights from: the trainer, at the
#: next sync (``"trainer"``), or an engine that serves the fleet's newest version, at
#: :meth:`EngineFleet.catch_up` (``"peer"``).
JoinSource = Literal["trainer", "peer"]

#: The keywords of generate_with_meta that are sampling parameters (the rest
#: are an engine's own, e.g. the embedded engine's ``timeout_s``).
_SAMPLING_KEYWORDS = frozenset(f.name for f in fields(SamplingParams)) | {"max_new_tokens"}


@runtime_checkable
class RespawningEngine(Protocol):
    """An engine that can replace its dead worker processes (the embedded engine)."""

    async def respawn_dead_workers(self) -> list[int]:
        """Start a fresh worker for every dead one; returns their ranks (ascending)."""
        ...


class EngineFleet(GenerateFromMeta):
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
        if on_engine_failure not in ("fail", "quarantine"):
            raise ValueError(
                f"on_engine_failure must be 'fail' or 'quarantine', got {on_engine_failure!r}"
            )
        if isinstance(min_engines, bool) or not isinstance(min_engines, int) or min_engines < 1:
            raise ValueError(f"min_engines must be an int >= 1, got {min_engines!r}")
        if refit not in ("all", "rolling"):
            raise ValueError(f"refit must be 'all' or 'rolling', got {refit!r}")
        if wave_source not in ("trainer", "peer"):
            raise ValueError(f"wave_source must be 'trainer' or 'peer', got {wave_source!r}")
        if wave_source == "peer" and refit != "rolling":
            raise ValueError("wave_source='peer' takes a rolling fleet (refit='rolling')")
        if isinstance(max_unavailable, bool) or not (
            (isinstance(max_unavailable, int) and max_unavailable >= 1)
            or (isinstance(max_unavailable, float) and 0.0 < max_unavailable < 1.0)
        ):
            raise ValueError(
                "max_unavailable must be an int >= 1 or a fraction in (0, 1), "
                f"got {max_unavailable!r}"
            )
        if max_version_lag is not None and (
            isinstance(max_version_lag, bool)
            or not isinstance(max_version_lag, int)
            or max_version_lag < 0
        ):
            raise ValueError(
                f"max_version_lag must be None or an int >= 0, got {max_version_lag!r}"
            )
        # A plain list: engines_of would take a fleet given here for its members.
        #: Every engine ever in the fleet, in order (quarantined ones included).
        self.members: list[Any] = list(engines_of(list(engines)))
        self.on_engine_failure: OnEngineFailure = on_engine_failure
        self.min_engines = min_engines
        self.probe_timeout_s = probe_timeout_s
        self.refit: FleetRefit = refit
        self.max_unavailable = max_unavailable
        self.max_version_lag = max_version_lag
        self.wave_source: JoinSource = wave_source
        # The wave a rolling sync is refitting (None: none); syncs reach only it.
        self._wave: list[Any] | None = None
        # By id(): the version each engine serves (from on_weights_committed), and why
        # an engine in service serves nothing (a failed wave left it unfit).
        self._versions: dict[int, int] = {}
        self._unfit: dict[int, str] = {}
        # Membership, by id(): absent = in service.
        self._joining: set[int] = set()
        self._quarantined: dict[int, str] = {}
        self._joined: list[str] = []
        # Engines waiting for a catch-up from a peer (add_engine(source="peer")), by id():
        # why their last catch-up failed (None: none tried yet). No sync reaches them.
        self._catching_up: dict[int, str | None] = {}
        # By id(): engines a sync paused (from pause_generation to resume_generation) and
        # engines a catch-up copies from or into. Each side waits for the other under
        # _gate: a sync never writes an engine whose bytes are moving to a peer.
        self._refitting: set[int] = set()
        self._copying: set[int] = set()
        self._gate = anyio.Condition()
        self._catch_up_lock = anyio.Lock()
        self._listeners: list[Callable[[], None]] = []
        #: Incremented by every membership change (a quarantine, an add_engine).
        self.membership_epoch = 0
        #: Each engine's first global worker rank, once assigned.
        self._offsets: list[int] | None = None
        self._num_workers = 0
        self._assigning = anyio.Lock()
        # Why generate() refuses on account of a LoRA adapter load across the fleet.
        self._lora_refusal: str | None = None
        for engine in self.members:
            self._relay_discards(engine)

    def __len__(self) -> int:
        return len(self.engines)

    def __repr__(self) -> str:
        return f"EngineFleet({', '.join(type(e).__name__ for e in self.engines)})"

    # -- membership ------------------------------------------------------------

    @property
    def engines(self) -> list[Any]:
        """The engines syncs reach, in order: those in service and those joining
        (never a quarantined one, nor one waiting for a catch-up from a peer); during a
        rolling refit's wave, the wave's."""
        scope = self.members if self._wave is None else self._wave
        return [
            e for e in scope if id(e) not in self._quarantined and id(e) not in self._catching_up
        ]

    def _in_service(self) -> list[Any]:
        """Neither quarantined nor joining nor waiting for a catch-up (whatever a rolling
        refit is doing)."""
        away = self._quarantined.keys() | self._joining | self._catching_up.keys()
        return [e for e in self.members if id(e) not in away]

    @property
    def serving(self) -> list[Any]:
        """The engines new generate calls go to: in service, not left unfit by a failed
        wave, and, where there are others, neither in the wave a rolling refit is
        refitting nor more than ``max_version_lag`` versions behind."""
        fit = [e for e in self._in_service() if id(e) not in self._unfit]
        current = fit
        if self.max_version_lag is not None:
            known = [self._versions[id(e)] for e in fit if id(e) in self._versions]
            floor = max(known, default=0) - self.max_version_lag
            current = [e for e in fit if self._versions.get(id(e), floor) >= floor]
        away = {id(e) for e in self._wave or ()}
        # With every current engine in the wave, requests wait for its resume.
        return [e for e in current if id(e) not in away] or current or fit

    @property
    def versions(self) -> dict[str, int | None]:
        """``{label: version}`` of every engine not quarantined: the version it last
        committed (None: none since it started, or it discarded its weights, or a
        failed wave left it unfit)."""
        return {
            self._name(e): self._versions.get(id(e))
            for e in self.members
            if id(e) not in self._quarantined
        }

    @property
    def unfit(self) -> dict[str, str]:
        """``{label: reason}`` of the engines a failed wave left serving nothing."""
        return {self._name(e): why for e in self.members if (why := self._unfit.get(id(e)))}

    # -- rolling refits (RollingEngines) -----------------------------------------

    @property
    def rolling(self) -> bool:
        """True when syncs refit the fleet in waves (``refit="rolling"``)."""
        return self.refit == "rolling"

    def waves(self) -> list[list[Any]]:
        """The next sync's waves: every engine the sync reaches once, in fleet order, at
        most ``max_unavailable`` of those in service per wave; the engines that serve
        nothing (joining, unfit) ride in the first. ``refit="all"``: one wave."""
        engines = self.engines
        if not self.rolling:
            return [engines]
        idle = [e for e in engines if id(e) in self._joining or id(e) in self._unfit]
        busy = [e for e in engines if all(e is not i for i in idle)]
        size = self.max_unavailable
        if isinstance(size, float):
            size = max(1, int(size * len(busy)))
        waves = [busy[i : i + size] for i in range(0, len(busy), size)] or [[]]
        waves[0] = idle + waves[0]
        return [wave for wave in waves if wave]

    @property
    def peer_waves(self) -> bool:
        """True when a rolling sync's waves after the first copy from a peer
        (``wave_source="peer"``, :meth:`copy_wave`)."""
        return self.rolling and self.wave_source == "peer"

    async def copy_wave(self, version: int, *, timeout_s: float = 60.0) -> int | None:
        """Copy ``version`` into every engine of the wave in progress from an engine
        outside it that committed ``version`` (worker to worker, verified against the
        peer's digests: :func:`~aiosync.engines._peer.copy_weights`), one engine after
        the other, spreading them over the peers; returns the bytes the peers sent.
        None (nothing copied): no engine outside the wave serves ``version``: the
        trainer's transport moves this wave too.

        Raises:
            RefitMismatchError, RefitVerificationError, TransportError, SyncTimeoutError:
                as :func:`~aiosync.engines._peer.copy_weights`, naming the engine.
        """
        wave = self.engines
        peers = [
            e
            for e in self._in_service()
            if self._versions.get(id(e)) == version
            and id(e) not in self._unfit
            and all(e is not w for w in wave)
        ]
        if not peers:
            return None
        nbytes = 0
        for i, engine in enumerate(wave):
            peer = peers[i % len(peers)]
            done = await copy_weights(
                peer,
                engine,
                peer_label=self._name(peer),
                label=self._name(engine),
                version=version,
                host="127.0.0.1",
                timeout_s=timeout_s,
            )
            nbytes += done.nbytes
        return nbytes

    def begin_wave(self, engines: Sequence[Any]) -> None:
        """Narrow the fleet to ``engines``: :attr:`engines` (what a sync reaches) is
        theirs, and the membership epoch moves (the transport re-forms over them).

        Raises:
            ValueError: a wave is in progress, or an engine is not in the fleet.
        """
        if self._wave is not None:
            raise ValueError("a rolling refit's wave is already in progress")
        for engine in engines:
            if all(engine is not e for e in self.engines):
                raise ValueError(f"{type(engine).__name__} at {id(engine):#x} is not in the sync")
        self._wave = list(engines)
        self._membership_changed()

    def end_wave(self, *, committed: bool) -> None:
        """Widen the fleet again after a wave. ``committed=False`` (its transfer failed
        or was cancelled): its engines may hold part of a version and are *unfit*, serving
        nothing until a later sync commits them. No wave in progress: nothing."""
        if self._wave is None:
            return
        if not committed:
            for engine in self.engines:
                self._unfit[id(engine)] = "a rolling refit failed while it was in its wave"
                self._versions.pop(id(engine), None)
        self._wave = None
        self._membership_changed()

    @property
    def quarantined(self) -> dict[str, str]:
        """``{label: reason}`` of the engines set aside."""
        return {self._name(e): why for e in self.members if (why := self._quarantined.get(id(e)))}

    def add_engine(self, engine: Any, *, source: JoinSource = "trainer") -> None:
        """Bring ``engine`` (a new one, or a quarantined one healed or respawned) in.

        ``source="trainer"``: as *joining*: the next sync gives it every tensor; it
        serves once that committed. ``source="peer"``: it waits for :meth:`catch_up`,
        which copies the newest version the fleet serves into it from an engine that
        serves it; no sync reaches it until then. An engine waiting for a catch-up
        (one failed, say) may be added again with the other source.

        Raises:
            ValueError: an unknown ``source``, or ``engine`` is already in the fleet
                (neither quarantined nor waiting for a catch-up).
        """
        if source not in ("trainer", "peer"):
            raise ValueError(f"source must be 'trainer' or 'peer', got {source!r}")
        away = self._quarantined.keys() | self._catching_up.keys()
        if any(e is engine and id(e) not in away for e in self.members):
            raise ValueError(f"{self._name(engine)} is already in the fleet")
        if not any(e is engine for e in self.members):
            self.members.append(engine)
            self._relay_discards(engine)
        self._quarantined.pop(id(engine), None)
        if source == "peer":
            # Whatever it served before (a quarantined engine) is no version of the fleet's.
            self._versions.pop(id(engine), None)
            self._unfit.pop(id(engine), None)
            self._catching_up[id(engine)] = None
            return  # no sync reaches it: the synchronizer's membership is unchanged
        self._catching_up.pop(id(engine), None)
        self._joining.add(id(engine))
        self._membership_changed()

    @property
    def catching_up(self) -> dict[str, str | None]:
        """``{label: why its last catch-up failed (None: none tried)}`` of the engines
        waiting for :meth:`catch_up` (``add_engine(engine, source="peer")``)."""
        return {
            self._name(e): self._catching_up[id(e)]
            for e in self.members
            if id(e) in self._catching_up
        }

    async def catch_up(self, *, host: str = "127.0.0.1", timeout_s: float = 60.0) -> list[CatchUp]:
        """Copy the newest version the fleet serves into every engine waiting for a
        catch-up (``add_engine(engine, source="peer")``), one after the other, each from
        an engine that serves that version, worker to worker; each then serves, labelled
        with that version (``on_weights_committed``). The trainer is not involved: its
        source is not read and its synchronizer sends nothing, and it may sync meanwhile
        (a sync waits, in :meth:`pause_generation`, before it refits the peer or the
        engine being copied into; this call waits for a sync refitting the peer).

        The peer: among the engines in service and fit, those at the newest known version
        (:attr:`versions`), the first not being refit. Its weights were checked against
        the trainer's when it committed that version if its synchronizer verifies
        (``verify=True``); the copy is checked against the peer's: the SHA-256 of every
        tensor each worker holds (``aiosync_weight_digests``) must match, or the engine
        keeps waiting, its weights invalid (refusing to generate). Costs: the peer's
        workers hold one more host copy of their weights while they send; the bytes
        move once, over gloo between the paired workers.

        Args:
            host: the address the engines' workers reach this process at (a rendezvous
                store of a few keys) and their gloo pairs bind to; loopback: every
                engine on this machine.
            timeout_s: limit of each wait: for a sync refitting the peer, each pair's
                formation, each tensor's send and receive, seconds.

        Returns:
            One :class:`CatchUp` per engine that caught up, in fleet order (empty: none
            waiting).

        Raises:
            SyncError: no engine in service serves a committed version (sync the fleet
                first).
            RefitMismatchError: the peer holds another layout (another
                tensor-parallel size, other tensors, shapes or dtypes), before any byte
                moves; the engine keeps its weights and keeps waiting.
            RefitVerificationError: the copy differs from the peer's (named tensors);
                the engine keeps waiting, its weights invalid.
            TransportError, SyncTimeoutError: a worker died or a wait ran past
                ``timeout_s``; the engine keeps waiting.
            TypeError: the engine or its peer has no ``collective_rpc``.
            Each error names the engine it comes from (the peer, or the engine
            catching up); the engines after it are not tried.
        """
        async with self._catch_up_lock:
            done: list[CatchUp] = []
            for engine in [e for e in self.members if id(e) in self._catching_up]:
                label = self._name(engine)
                if not isinstance(engine, EngineWorkers):
                    raise TypeError(f"{label} has no collective_rpc: it cannot catch up")
                try:
                    done.append(await self._catch_up_one(engine, host, timeout_s))
                except Exception as exc:
                    self._catching_up[id(engine)] = f"{type(exc).__name__}: {exc}"
                    raise
            return done

    async def _catch_up_one(self, engine: Any, host: str, timeout_s: float) -> CatchUp:
        """:meth:`catch_up` of one engine: wait for a peer that no sync is refitting,
        hold both out of syncs while the bytes move and are verified, then put the
        engine in service at the peer's version."""
        label = self._name(engine)
        try:
            with anyio.fail_after(timeout_s):
                async with self._gate:
                    while (peer := self._peer_for(label)) is None:
                        await self._gate.wait()
                    self._copying.update((id(peer), id(engine)))
        except TimeoutError:
            raise SyncTimeoutError(
                f"{label}: every engine at the newest version was being refit by a sync "
                f"for {timeout_s} s"
            ) from None
        version = self._versions[id(peer)]
        try:
            if not isinstance(peer, EngineWorkers):
                raise TypeError(f"{self._name(peer)} has no collective_rpc: no catch-up from it")
            done = await copy_weights(
                peer,
                engine,
                peer_label=self._name(peer),
                label=label,
                version=version,
                host=host,
                timeout_s=timeout_s,
            )
            if isinstance(engine, VersionedEngine):
                await engine.on_weights_committed(version)
            # In service before the syncs waiting for these engines go on: a sync that
            # starts now reaches it like every other engine.
            del self._catching_up[id(engine)]
            self._versions[id(engine)] = version
            self._unfit.pop(id(engine), None)
            self._membership_changed()
        finally:
            with anyio.CancelScope(shield=True):
                async with self._gate:
                    self._copying.difference_update((id(peer), id(engine)))
                    self._gate.notify_all()
        return done

    def _peer_for(self, label: str) -> Any | None:
        """The engine to copy from: in service and fit, at the newest version known, the
        first that no sync is refitting; None while every such engine is refit.

        Raises:
            SyncError: no engine in service has committed a version.
        """
        fit = [e for e in self._in_service() if id(e) not in self._unfit]
        known = [self._versions[id(e)] for e in fit if id(e) in self._versions]
        if not known:
            raise SyncError(
                f"{label} cannot catch up from a peer: no engine in service serves a "
                "committed version (sync the fleet first)"
            )
        newest = max(known)
        at_newest = [e for e in fit if self._versions.get(id(e)) == newest]
        return next((e for e in at_newest if id(e) not in self._refitting), None)

    def take_joined(self) -> list[str]:
        """The labels of the engines that went into service at the last commit (once)."""
        joined, self._joined = self._joined, []
        return joined

    async def set_aside_failed(self, error: BaseException) -> list[tuple[str, str]]:
        """After a sync failed with ``error``: check every engine in the sync and, with
        ``on_engine_failure="quarantine"``, quarantine those that fail the check,
        provided ``min_engines`` stay in service. Returns ``[(label, reason)]`` of the
        engines set aside (empty: none, or too few would remain: the sync fails)."""
        if self.on_engine_failure != "quarantine":
            return []
        engines = self.engines
        reasons: list[str | None] = [None] * len(engines)

        async def check(i: int, engine: Any) -> None:
            try:
                with anyio.fail_after(self.probe_timeout_s):
                    await self._probe(engine)
            except TimeoutError as exc:
                # A hung engine (a stopped worker, a frozen server) answers nothing.
                detail = f" ({type(exc).__name__}: {exc})" if str(exc) else ""
                reasons[i] = f"did not answer its probe within {self.probe_timeout_s} s{detail}"
            except Exception as exc:
                reasons[i] = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)

        async with anyio.create_task_group() as tg:
            for i, engine in enumerate(engines):
                tg.start_soon(check, i, engine)
        failed = [(e, why) for e, why in zip(engines, reasons, strict=True) if why is not None]
        if not failed:
            return []
        left = [e for e in self._in_service() if all(e is not f for f, _ in failed)]
        if len(left) < self.min_engines:
            # The sync fails with ``error``, which may name a healthy engine (one
            # that waited for the hung one): say which failed the probe.
            failed_probe = "; ".join(f"{self._name(e)}: {why}" for e, why in failed)
            error.add_note(f"failed the fleet's probe after it: {failed_probe}")
            _log.warning(
                "engine fleet: %d engine(s) failed their check after a failed sync, which "
                "would leave %d in service (min_engines=%d): the sync fails",
                len(failed),
                len(left),
                self.min_engines,
            )
            return []
        labels = [
            (self._name(e), f"{why} (after the sync failed with {error!r})") for e, why in failed
        ]
        for (engine, _why), (_label, reason) in zip(failed, labels, strict=True):
            self._quarantined[id(engine)] = reason
            self._joining.discard(id(engine))
        self._membership_changed()
        return labels

    async def _probe(self, engine: Any) -> None:
        """One engine's probe after a failed sync: its own check
        (:class:`~aiosync.capabilities.HealthReporting`: workers alive, server
        answering), then a round trip to every worker (``aiosync_device_identity``,
        :class:`~aiosync.capabilities.EngineWorkers`): a stopped or hung worker
        passes the first (its process lives) but not the second (case C35).

        Raises:
            TimeoutError: a worker did not answer within ``probe_timeout_s``.
            TransportError: a worker (or the engine's process) is dead.
            Whatever the engine's ``check_health`` raises.
        """
        if isinstance(engine, HealthReporting):
            await engine.check_health()
        if isinstance(engine, EngineWorkers):
            try:
                await engine.collective_rpc(
                    "aiosync_device_identity", timeout_s=self.probe_timeout_s
                )
            except (TimeoutError, TransportError):
                raise
            except Exception:
                # Every worker answered, if with an error (one without aiosync's
                # worker methods): each is alive, which is all the probe asks.
                return

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

    def _membership_changed(self) -> None:
        self.membership_epoch += 1
        self._offsets = None

    def _name(self, engine: Any) -> str:
        index = next(i for i, e in enumerate(self.members) if e is engine)
        return f"engine {index} of {len(self.members)} ({type(engine).__name__})"

    # -- fan-out ---------------------------------------------------------------

    async def _on_each(self, call: Callable[[int, Any], Awaitable[_T]]) -> list[_T]:
        """``call(i, engine)`` on every engine concurrently; results in engine order.
        The first engine to fail cancels the others; its error names the engine."""
        return await each_named(self.engines, call, self._label)

    def _label(self, index: int) -> str:
        """The label of ``self.engines[index]`` (its place among all members)."""
        return self._name(self.engines[index])

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
        offsets = self._offsets  # the engines' respawns reset it (see __init__)
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

    # -- GenerationBackend -----------------------------------------------------

    async def on_weights_committed(self, version: int) -> None:
        """Tell every engine that reports weight versions that ``version`` landed."""

        async def report(i: int, engine: Any) -> None:
            if isinstance(engine, VersionedEngine):
                await engine.on_weights_committed(version)

        await self._on_each(report)
        committed = self.engines
        for engine in committed:
            self._versions[id(engine)] = version
            self._unfit.pop(id(engine), None)
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
        async with self._gate:
            while any(id(e) in self._copying for e in self.engines):
                await self._gate.wait()
            self._refitting.update(id(e) for e in self.engines)
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
            # Every engine a sync paused (one set aside since included): no sync writes now.
            with anyio.CancelScope(shield=True):
                async with self._gate:
                    self._refitting.clear()
                    self._gate.notify_all()

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
