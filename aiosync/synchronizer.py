"""The synchronizer: what every transport shares, once.

:class:`WeightSynchronizer` plays the role of httpx's client: it holds a
:class:`~aiosync.transport.Transport` (``aiosync.transports.ipc``, ``.collective``,
``.http``, ...: the phases ``open``, ``send``, ``rejoin``, ``close``), and the
training loop never asks which one it holds. What every transport shares lives
here, once: argument checks before anything moves, versions, events, the
in-flight pause, the engine's discard listener and version label, the colocated
wake bracket, timeouts. The trainer's side is :mod:`aiosync.sources`, the
engine's claims :mod:`aiosync.ownership`, the engine's optional capabilities the
Protocols of :mod:`aiosync.capabilities`. See ``docs/lifecycle.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Self, TypedDict, cast

import anyio
import anyio.to_thread

from . import ownership
from ._colocated import colocated_refit, wake_engines
from ._config import DEFAULT_EVENT_BACKLOG, Timeouts
from ._delta_refit import Baseline, DeltaRefit
from ._fanout import each_named
from ._fleet_sync import (
    check_fleet_options,
    elastic_fleet,
    elastic_transfer,
    rolling_fleet,
    rolling_transfer,
)
from ._hf_config import compare_hf_configs
from ._kv_scales import attention_layers, kv_scale_entries
from ._live_check import verify_live
from ._previous import arm_previous, restore_previous
from .capabilities import (
    IN_FLIGHT_POLICIES,
    ConfigReporting,
    DiscardNotifier,
    Engine,
    InFlightPolicy,
    PausableEngine,
    PeerWaves,
    VersionedEngine,
    engines_of,
    implements,
)
from .cluster import Ranks, SingleRank
from .errors import (
    OwnershipError,
    SyncError,
    SyncTimeoutError,
    UnsupportedOptionError,
)
from .events import EventSubscription, VersionEventKind, _EventHub
from .options import ON_FAILURE, OnFailure, TransportCapabilities
from .sources import ConfigSource, Preflight, RefitManifest, RefitSource
from .transport import Transferred, Transport

__all__ = [
    "GenerationBackend",
    "KVScales",
    "SharedKeywords",
    "Transferred",
    "WeightSynchronizer",
]

#: FP8 KV-cache scales: ``{layer_index_or_name: scale}`` (a float per layer).
KVScales = Mapping[str | int, float]

#: The engine as the training loop sees it (the older name of
#: :class:`~aiosync.capabilities.Engine`).
GenerationBackend = Engine

_log = logging.getLogger(__name__)


def _check_in_flight(in_flight: object) -> InFlightPolicy:
    """``in_flight`` as an :data:`InFlightPolicy`; ValueError for anything else."""
    for policy in IN_FLIGHT_POLICIES:
        if in_flight == policy and isinstance(in_flight, str):
            return policy
    raise ValueError(f"in_flight must be one of {IN_FLIGHT_POLICIES}, got {in_flight!r}")


def _check_kv_scales(kv_scales: KVScales | None) -> None:
    if kv_scales is None:
        return
    if not isinstance(kv_scales, Mapping):
        raise TypeError(f"kv_scales must be a mapping, got {type(kv_scales).__name__}")
    for key, value in kv_scales.items():
        if not isinstance(key, str | int) or isinstance(key, bool):
            raise TypeError(f"kv_scales key {key!r} must be a layer index or a name")
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"kv_scales[{key!r}] must be a float, got {type(value).__name__}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"kv_scales[{key!r}] must be finite and > 0, got {value}")


class SharedKeywords(TypedDict, total=False):
    """The keywords every shipped transport's constructor passes on, unchanged, to
    :class:`WeightSynchronizer` (``**shared``): see its Args."""

    timeouts: Timeouts | None
    sync_timeout_s: float | None
    event_backlog: int
    in_flight: InFlightPolicy
    initial_version: int
    on_failure: OnFailure


class _PauseWindow:
    """When a sync paused the engine (``since``: ``time.perf_counter()``; None: never)."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def open(self) -> None:
        """The pause begins now, unless it began already (a fleet's later round)."""
        if self.since is None:
            self.since = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the pause began, 0.0 if it never did."""
        return 0.0 if self.since is None else time.perf_counter() - self.since


class WeightSynchronizer:
    """Moves the trainer's weights to every generation worker, one version at a time.

    The loop's handshake: after each optimizer step ``await mark_stale()``;
    before generating, if :attr:`is_stale`, ``await sync_weights()`` then
    ``await generation.prepare_for_generation()`` (see :func:`refit_if_stale`).
    ``async with sync:`` initializes the transport (:meth:`init_communicator`)
    and shuts it down at the end of the block.

    Versions: :attr:`policy_version` is the trainer's latest,
    :attr:`weight_version` the version live on **all** workers (both start at
    ``initial_version``, 0 by default). Both
    only go up. A failed or cancelled sync leaves :attr:`weight_version`
    unchanged and :attr:`is_stale` true.

    The bytes move through a :class:`~aiosync.transport.Transport` passed in as
    ``transport`` (its phases ``open``, ``send``, ``rejoin``, ``close``, and its
    ``capabilities``); everything else is done here. The transports aiosync ships
    are subclasses that are their own transport (``IPCWeightSynchronizer`` ...:
    they implement the phases and pass no ``transport``).

    In-flight requests: when the engine is a
    :class:`~aiosync.capabilities.PausableEngine`, every sync pauses it with
    ``in_flight`` before the first byte reaches it, and resumes it once the
    version committed, or failed, or was cancelled. A request the engine is
    generating meanwhile is never computed by a mix of two weight sets without
    saying so: ``"wait"`` (the default) finishes it on the old weights first,
    ``"abort"`` ends it (marked aborted), ``"keep"`` continues it on the new ones.

    Args:
        policy: the trainer's :class:`RefitSource`.
        generation: the engine (an :class:`~aiosync.capabilities.Engine`), or a
            fleet of them.
        transport: what moves the bytes (:class:`~aiosync.transport.Transport`);
            None: this object itself (a subclass implementing the phases).
        timeouts: every limit (:class:`~aiosync.Timeouts`); default ``Timeouts()``.
        sync_timeout_s: overrides ``timeouts.sync_s``: the limit for a whole
            ``sync_weights`` call, seconds (the pause, a ``"wait"`` included).
        event_backlog: default ``max_backlog`` of :meth:`subscribe`, in events.
        in_flight: the default :data:`InFlightPolicy` of :meth:`sync_weights`.
        initial_version: where both versions start (a trainer resumed from its
            checkpoint at step N passes N, so that versions continue); as with 0,
            starting equal assumes the engine loaded that checkpoint (else
            ``mark_stale()`` once).

    Raises:
        ValueError: a limit not finite and > 0, ``event_backlog < 1``,
            ``initial_version < 0``, or ``in_flight`` not one of :data:`IN_FLIGHT_POLICIES`.
        TypeError: ``event_backlog`` or ``initial_version`` is not an int, or
            there is no :class:`~aiosync.transport.Transport`.
    """

    #: What the transport can do, as data: the factory refuses a shared option outside
    #: it, the conformance kit runs its cells. A ``sync_weights(kv_scales=...)`` on one
    #: without ``kv_scales`` raises NotImplementedError(:attr:`kv_scales_refusal`) before
    #: anything moves.
    capabilities: TransportCapabilities = TransportCapabilities()
    kv_scales_refusal: ClassVar[str] = "this transport does not move FP8 KV-cache scales"

    @property
    def supports_kv_scales(self) -> bool:
        """Whether the transport moves FP8 KV-cache scales (``capabilities.kv_scales``)."""
        return self.transport.capabilities.kv_scales

    def __init__(
        self,
        policy: RefitSource,
        generation: Any,
        *,
        transport: Transport | None = None,
        timeouts: Timeouts | None = None,
        sync_timeout_s: float | None = None,
        event_backlog: int = DEFAULT_EVENT_BACKLOG,
        in_flight: InFlightPolicy = "wait",
        initial_version: int = 0,
        ranks: Ranks | None = None,
        on_failure: OnFailure = "refuse",
    ) -> None:
        _check_in_flight(in_flight)
        if transport is None and isinstance(self, Transport):
            transport = self
        if not isinstance(transport, Transport):
            raise TypeError(
                "WeightSynchronizer needs a transport: pass transport=<an aiosync.Transport> "
                f"(open, send, rejoin, close and capabilities), got {type(transport).__name__}"
            )
        #: What moves the bytes (this object itself for the shipped transports).
        self.transport: Transport = transport
        if transport is not self:
            self.capabilities = transport.capabilities
        if isinstance(initial_version, bool) or not isinstance(initial_version, int):
            raise TypeError(f"initial_version must be an int, got {type(initial_version).__name__}")
        if initial_version < 0:
            raise ValueError(f"initial_version must be >= 0, got {initial_version}")
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise TypeError(f"timeouts must be an aiosync.Timeouts, got {type(timeouts).__name__}")
        if sync_timeout_s is not None and not (
            isinstance(sync_timeout_s, int | float) and 0 < sync_timeout_s < math.inf
        ):
            raise ValueError(f"sync_timeout_s must be a finite number > 0, got {sync_timeout_s!r}")
        if isinstance(event_backlog, bool) or not isinstance(event_backlog, int):
            raise TypeError(f"event_backlog must be an int, got {type(event_backlog).__name__}")
        if event_backlog < 1:
            raise ValueError(f"event_backlog must be >= 1, got {event_backlog}")
        self.policy = policy
        self.generation = generation
        #: Every limit this synchronizer applies (:class:`~aiosync.Timeouts`).
        self.timeouts = (timeouts or Timeouts()).with_keywords(sync_timeout_s=sync_timeout_s)
        #: What :meth:`sync_weights` does with requests in flight (its default).
        self.in_flight: InFlightPolicy = in_flight
        #: The trainer's manifest, read by :meth:`_read_manifest` at init (None before).
        self._manifest: RefitManifest | None = None
        self._event_backlog = event_backlog
        self._policy_version = initial_version
        self._weight_version = initial_version
        # True when the engine may hold weights that are not ``weight_version``
        # (a sync failed half-way, or the engine discarded its weights).
        self._engine_dirty = False
        # Counts the engine's weight discards, so that one during a sync is not
        # cleared by that sync's success.
        self._discards = 0
        self._initialized = False
        #: This process among the trainer's ranks (:class:`~aiosync.cluster.Ranks`).
        self.ranks: Ranks = ranks if ranks is not None else SingleRank()
        self._closed = False
        self._lock = anyio.Lock()
        # Held while a sync reads the source and while the trainer updates it
        # (policy_update): a version is one consistent set of weights.
        self._source_lock = anyio.Lock()
        self._events = _EventHub(lambda: (self._policy_version, self._weight_version))
        #: This synchronizer's owner token: its worker-side sessions and its claim on
        #: the engine are keyed by it (see :class:`~aiosync.OwnershipError`).
        self.owner = secrets.token_hex(8)
        # Why another synchronizer's commit took the engine from this one (None: not).
        self._superseded: str | None = None
        # The elastic fleet's membership_epoch the transport was last initialized for.
        self._membership_seen: int | None = None
        # One listener per synchronizer, on the engine (a fleet forwards to its
        # members) or on each engine of a plain list; removed by shutdown().
        members = generation if isinstance(generation, list | tuple) else (generation,)
        self._notifiers = [e for e in members if isinstance(e, DiscardNotifier)]
        for notifier in self._notifiers:
            notifier.add_weights_discarded_listener(self._invalidate_engine_weights)
        #: A delta transport's baseline and which engines hold it (None: every sync is
        #: full). The transport sets it; this class advances and drops the baseline.
        self.delta: DeltaRefit[Any] | None = None
        check_fleet_options(self)
        self._on_failure: OnFailure = "refuse"
        self.on_failure = on_failure
        #: Host bytes the workers reached by the last initialization keep for
        #: ``on_failure="serve_previous"`` (0: not armed).
        self.previous_nbytes = 0
        # Whether the sync in progress started from one whole version, and whether it
        # began labelling the engines with its own (then nothing is put back).
        self._previous_good = False
        self._labelling = False

    @property
    def on_failure(self) -> OnFailure:
        """What the engines serve after a failed or cancelled sync (:data:`OnFailure`)."""
        return self._on_failure

    @on_failure.setter
    def on_failure(self, value: OnFailure) -> None:
        """Set before :meth:`init_communicator` (which arms the workers).

        Raises:
            ValueError: not one of :data:`~aiosync.options.ON_FAILURE`.
            UnsupportedOptionError: ``"serve_previous"`` on a transport without
                ``capabilities.serve_previous``.
            SyncError: already initialized.
        """
        if value not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {value!r}")
        refusal = self.transport.capabilities.refusal("on_failure", value)
        if refusal is not None:
            raise UnsupportedOptionError(
                f"{type(self.transport).__name__} does not honour {refusal}"
            )
        if self._initialized and value != self._on_failure:
            raise SyncError("set on_failure before init_communicator()")
        self._on_failure = value

    @property
    def delta_baseline(self) -> Baseline | None:
        """What the workers hold, for delta syncs (None: ``delta=False``)."""
        return self.delta.baseline if self.delta is not None else None

    @property
    def sync_timeout_s(self) -> float:
        """The limit for a whole :meth:`sync_weights` call, seconds (``timeouts.sync_s``)."""
        return self.timeouts.sync_s

    # -- versions -------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The trainer's latest weight version (starts at ``initial_version``)."""
        return self._policy_version

    @property
    def weight_version(self) -> int:
        """The version live on all generation workers (starts at ``initial_version``)."""
        return self._weight_version

    @property
    def is_stale(self) -> bool:
        """True when the engine must be refit before it generates.

        ``policy_version > weight_version``, or the engine's weights are not
        trustworthy (a sync failed half-way, the engine discarded them, or
        another synchronizer committed its own into the engine).
        """
        return self._policy_version > self._weight_version or self._engine_dirty

    async def mark_stale(self, version: int | None = None) -> int:
        """Record an optimizer step; returns the new ``policy_version``.

        Args:
            version: the new version; by default ``policy_version + 1``.

        Raises:
            ValueError: ``version`` is not greater than ``policy_version``.
            SyncError: the synchronizer was shut down.
        """
        self._check_open()
        if version is None:
            version = self._policy_version + 1
        elif isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        elif version <= self._policy_version:
            raise ValueError(
                f"version must be greater than policy_version={self._policy_version}, got {version}"
            )
        self._policy_version = version
        self._events.publish(VersionEventKind.STALE, version)
        return version

    @contextlib.asynccontextmanager
    async def policy_update(self) -> AsyncIterator[int]:
        """Wrap the trainer's optimizer step: ``async with sync.policy_update(): optimizer.step()``.

        Waits while a sync reads the source, and holds syncs off while the block
        runs, so that a sync never streams a mix of two versions (tensors read
        before and after the step). On a normal exit the new version is marked
        stale (``policy_version + 1``, as :meth:`mark_stale`); an exception in
        the block propagates and marks nothing. Yields the version the block
        produces. The wait costs the trainer at most one refit's source read.

        Raises:
            SyncError: the synchronizer was shut down.
        """
        self._check_open()
        async with self._source_lock:
            yield self._policy_version + 1
            await self.mark_stale()

    def _invalidate_engine_weights(self) -> None:
        """The engine no longer holds ``weight_version`` (e.g. woken after
        discarding its weights); a sync is required before it generates.
        A sync in flight when this happens fails instead of committing."""
        self._engine_dirty = True
        self._discards += 1

    # -- lifecycle ------------------------------------------------------------

    async def init_communicator(self) -> None:
        """Set up the transport (its ``open``: manifests compared, sockets opened, groups
        formed), after the engine's workers exist. May be called again (re-init after a
        respawn); ``async with sync:`` calls it once.

        Raises:
            SyncError: shut down.
            RefitMismatchError, TransportError, OwnershipError: from the transport's
                ``open`` (the manifests differ, a worker is unreachable, ...).
        """
        self._check_open()
        await self.transport.open(self)
        await self._opened()

    async def _opened(self) -> None:
        """The transport is (re-)opened: the synchronizer's own bookkeeping (delta
        watch, the fleet's membership, take-over, rank agreement on staleness)."""
        self._check_open()
        rolling = rolling_fleet(self)
        peers = cast(PeerWaves, rolling) if implements(rolling, PeerWaves) else None
        if self.delta is not None and peers is not None and peers.peer_waves:
            # A peer's copy leaves no delta base on the workers it writes.
            raise UnsupportedOptionError(
                "delta=True with EngineFleet(wave_source='peer'): the waves a peer "
                "copies hold no delta baseline; use one or the other"
            )
        if self._on_failure == "serve_previous" and self._drives_generation():
            self.previous_nbytes = await arm_previous(self.generation, self.timeouts.rpc_s)
        self._initialized = True
        if self.delta is not None:
            self.delta.watch(self._engines())
        fleet = elastic_fleet(self)
        if fleet is not None:
            self._membership_seen = fleet.membership_epoch
        # Initializing is the explicit take-over: a superseded synchronizer syncs again.
        self._superseded = None
        if ownership.held_by_another(self._engines(), self.owner):
            # The engine serves another synchronizer's weights, not this one's
            # weight_version (a restarted trainer's 0 included): sync first.
            self._engine_dirty = True
        dirty = await self._gather_ranks(self._engine_dirty)
        if dirty is not None:
            # Only the driver sees the engine; is_stale must be the same on every
            # rank, or the ranks that think they are current skip the gathers the
            # driver's sync waits for.
            self._engine_dirty = any(dirty)

    def _sharded(self) -> bool:
        """Whether this synchronizer is one of a sharded trainer's ranks (which must
        agree on every outcome): ``ranks.sharded``."""
        return self.ranks.sharded

    async def _gather_ranks(self, obj: Any) -> list[Any] | None:
        """Every trainer rank's ``obj`` (small, picklable), in rank order; None where
        there is no group of trainer ranks to gather over: ``ranks.gather``."""
        return await self.ranks.gather(obj)

    def _engines(self) -> tuple[Any, ...]:
        """The engine objects this process drives (a fleet's members); none on a
        sharded trainer's other ranks."""
        if self.generation is None or not self._drives_generation():
            return ()
        try:
            return engines_of(self.generation)
        except ValueError:
            return ()

    def _lose_engines(self, reason: str | None) -> None:
        """:class:`~aiosync.ownership.Owner`'s: another synchronizer committed into this
        one's engine (``reason``: which; the next sync raises it), or may have left it
        a mix of both (None). This one becomes stale."""
        if self._closed:
            return
        if not self._sharded():
            # A sharded trainer's driver turning stale alone would leave its
            # ranks disagreeing on is_stale; it learns at its next sync.
            self._engine_dirty = True
        if reason is not None:
            self._superseded = reason

    async def _read_manifest(self) -> RefitManifest:
        """The source's manifest, built in a worker thread (it may walk a large
        model or gather); kept for the argument checks of :meth:`sync_weights`."""
        self._manifest = await anyio.to_thread.run_sync(self.policy.prepare_refit_info)
        return self._manifest

    async def _check_model_configs(self) -> None:
        """Compare the trainer's HF config with each engine's, where both know it
        (:class:`ConfigSource`, :class:`~aiosync.capabilities.ConfigReporting`).

        Transports call it at init where they compare manifests (before any byte
        moves; on a sharded trainer inside the region whose errors the ranks share).

        Raises:
            RefitMismatchError: a field that changes the computation differs
                (named with both values, and the engine when there are several).
        """
        if not isinstance(self.policy, ConfigSource):
            return
        trainer = await anyio.to_thread.run_sync(self.policy.hf_config)
        if trainer is None:
            return
        engines = self._engines()
        count = len(engines)

        async def check(index: int, engine: object) -> None:
            if not isinstance(engine, ConfigReporting):
                return
            config = await engine.expected_config()
            if config is not None:
                # each_named puts "engine i of n: " in front when there are several.
                compare_hf_configs(trainer, config)

        await each_named(
            engines, check, lambda i: f"engine {i} of {count} ({type(engines[i]).__name__})"
        )

    def _rank(self) -> int:
        """This process's trainer rank (0 unless :meth:`_sharded`): ``ranks.rank``."""
        return self.ranks.rank

    def _check_sync_args(self, kv_scales: KVScales | None, in_flight: object) -> InFlightPolicy:
        """Every check of :meth:`sync_weights`' arguments, before any event or byte.

        Returns the in-flight policy to use. KV-scale layers are checked against
        the manifest once :meth:`_read_manifest` ran.
        """
        policy = _check_in_flight(self.in_flight if in_flight is None else in_flight)
        _check_kv_scales(kv_scales)
        if kv_scales is not None and not self.supports_kv_scales:
            raise NotImplementedError(self.kv_scales_refusal)
        if kv_scales:
            layers = attention_layers(self._manifest) if self._manifest else None
            kv_scale_entries(kv_scales, layers)
        return policy

    async def sync_weights(
        self, kv_scales: KVScales | None = None, *, in_flight: InFlightPolicy | None = None
    ) -> None:
        """Move the weights of the current ``policy_version`` to every worker.

        A call made while another sync runs waits for it, then syncs again only
        if still stale. Not stale: returns at once (the engine is not paused).

        When the engine is pausable, the sync pauses it with the in-flight policy
        before the first byte reaches it and resumes it after the version
        committed, and after a failure or cancellation too (shielded, bounded by
        ``timeouts.resume_s``, after a failure by ``timeouts.after_failure_s``;
        a resume error is logged and never hides the sync's own). The pause
        window, seconds, is the ``pause_s`` of the ``COMMITTED``/``FAILED`` event.

        Args:
            kv_scales: FP8 KV-cache scales, ``{layer_index: scale}`` (both
                ``k_scale`` and ``v_scale`` of that layer) or
                ``{"model.layers.{i}.self_attn.{k|v}_scale": scale}``; each
                worker loads them after the weights, as 0-d float32 tensors,
                before its weights count as valid.
            in_flight: this call's :data:`InFlightPolicy`; None: :attr:`in_flight`.

        Raises:
            TypeError, ValueError: malformed ``kv_scales`` or a layer without
                attention in the manifest, or an unknown ``in_flight``
                (before any event is published or anything moves).
            NotImplementedError: ``kv_scales`` on a transport that cannot move
                them (:attr:`supports_kv_scales`), likewise before anything.
            SyncTimeoutError: the sync (the pause included) ran past
                ``timeouts.sync_s`` seconds.
            RefitMismatchError, TransportError: from the transport, or from the
                engine's ``pause_generation`` (the sync then fails, and the engine
                is resumed).
            SyncError: not initialized, or shut down, or the engine discarded its
                weights while the sync ran (sync again).
            OwnershipError: another synchronizer committed into the engine since
                this one last initialized (the message names it); ``init_communicator()``
                takes the engine over again.
            Whatever the engine's ``resume_generation`` raised after the version
                committed (``weight_version`` has advanced; the engine may still
                be paused: call its ``resume_generation``).
        """
        policy = self._check_sync_args(kv_scales, in_flight)
        self._check_open()
        if not self._initialized:
            raise SyncError("await init_communicator() before sync_weights()")
        if self._superseded is not None and not self._sharded():
            raise ownership.refusal(type(self).__name__, self._superseded)
        # The version is read under the source lock: a policy_update in progress
        # finishes first, and the sync then moves (and names) the updated weights.
        async with self._lock, self._source_lock:
            self._check_open()
            await self._agree_not_superseded()
            if not self.is_stale:
                return
            version = self._policy_version
            discards = self._discards
            # Only weights that were one whole version can be served again on a failure.
            self._previous_good = not self._engine_dirty
            self._labelling = False
            if self.delta is not None:
                self.delta.begin()
            self._events.publish(VersionEventKind.SYNC_STARTED, version)
            start = time.perf_counter()
            pause = _PauseWindow()
            rolling = rolling_fleet(self)
            try:
                with anyio.fail_after(self.timeouts.sync_s):
                    self._preflight()
                    if rolling is not None:
                        moved, longest = await rolling_transfer(
                            self, rolling, version, kv_scales, policy, pause, discards
                        )
                    else:
                        moved, discards = await elastic_transfer(
                            self, version, kv_scales, self._pause_call(policy, pause), discards
                        )
                if rolling is None:
                    self._check_landed(version, discards)
                    await self._label_engine(version)
            except BaseException as exc:
                error, restored = await self._failed(version, exc, start, pause)
                if rolling is not None:
                    # A wave whose engines serve their previous version again is whole.
                    rolling.end_wave(committed=restored)
                raise error  # noqa: B904 (its own cause)
            self._commit(version)
            if rolling is not None:
                self._publish_committed(version, moved, start, longest)
                return
            resume_error: BaseException | None = None
            try:
                pause_s = await self._resume_after(pause.since, failed=False)
            except Exception as exc:
                resume_error = exc
                pause_s = pause.elapsed()
            self._publish_committed(version, moved, start, pause_s)
            if resume_error is not None:
                raise resume_error

    # -- the phases of a sync ----------------------------------------------------

    async def _agree_not_superseded(self) -> None:
        """A sharded trainer: only the driver knows another synchronizer took its
        engine; every rank learns it here, before any of them starts the source's
        gathers. Raises the refusal (OwnershipError) on every rank."""
        if not self._sharded():
            return
        refusals = await self._gather_ranks(self._superseded)
        for rank, refusal in enumerate(refusals or [self._superseded]):
            if refusal is not None:
                self._engine_dirty = True
                raise ownership.refusal(
                    type(self).__name__, refusal, None if rank == self._rank() else rank
                )

    def _preflight(self) -> None:
        """The source's own checks (:class:`~aiosync.Preflight`), before the pause and
        the first byte: a broken source leaves every engine as it was, serving (a
        sharded trainer's ranks check at their streams' start, where their votes agree)."""
        if implements(self.policy, Preflight) and not self._sharded():
            cast(Preflight, self.policy).preflight()

    def _pause_call(
        self, policy: InFlightPolicy, window: _PauseWindow
    ) -> Callable[[], Awaitable[None]] | None:
        """The engine's ``pause_generation`` with ``policy`` (None: not pausable); the
        window opens when it is called: a pause that fails half-way (some engines of a
        fleet paused) is resumed all the same."""
        pausable = self._pausable()
        if pausable is None:
            return None
        pause = functools.partial(pausable.pause_generation, policy, clear_cache=True)

        async def paused() -> None:
            window.open()
            await pause()

        return paused

    def _check_landed(self, version: int, discards: int) -> None:
        """After the bytes moved: the engine kept them (no discard since), and no other
        synchronizer committed into it meanwhile (the engine may then hold a mix of both:
        neither may claim it).

        Raises:
            SyncError: the engine discarded its weights.
            OwnershipError: another synchronizer committed.
        """
        if self._discards != discards:
            raise SyncError(
                f"the engine discarded its weights while version {version} was being "
                "synced: some workers may hold neither version; sync again"
            )
        if self._superseded is not None and not self._sharded():
            # Only a transport without worker sessions lets another commit meanwhile.
            ownership.taint(self._engines(), self.owner)
            raise OwnershipError(
                f"{self._superseded} while version {version} of "
                f"{type(self).__name__} was being synced: the engine may hold a "
                "mix of both; await init_communicator() and sync again"
            )

    async def _failed(
        self, version: int, exc: BaseException, start: float, pause: _PauseWindow
    ) -> tuple[BaseException, bool]:
        """A failed or cancelled sync: the engine counts as dirty unless its workers put
        their previous version back (``on_failure="serve_previous"``), the transport
        hears of it, the engine resumes (bounded), FAILED is published. Returns the
        error to raise (a timeout as :class:`SyncTimeoutError`) and whether the
        previous version was put back."""
        self._engine_dirty = True
        restored = False
        if self._on_failure == "serve_previous" and self._previous_good and not self._labelling:
            restored = self._drives_generation() and await restore_previous(
                self.generation, version, self.timeouts.after_failure_s
            )
            self._engine_dirty = not restored
            if restored:
                _log.warning(
                    "version %d failed; the engines serve version %d again",
                    version,
                    self._weight_version,
                )
        if self.delta is not None:
            self.delta.settle(committed=False)
        pause_s = await self._resume_after(pause.since, failed=True)
        self._events.publish(
            VersionEventKind.FAILED,
            version,
            duration_s=time.perf_counter() - start,
            error=repr(exc),
            pause_s=pause_s,
        )
        if isinstance(exc, TimeoutError) and not isinstance(exc, SyncTimeoutError):
            timeout = SyncTimeoutError(
                f"sync of version {version} exceeded {self.timeouts.sync_s} s"
            )
            timeout.__cause__ = exc
            return timeout, restored
        return exc, restored

    def _commit(self, version: int) -> None:
        """The version is live: the synchronizer's version advances and it claims the
        engines (another synchronizer's next sync into them is refused)."""
        self._weight_version = max(self._weight_version, version)
        self._engine_dirty = False
        if self.delta is not None:
            self.delta.settle(committed=True)
        ownership.claim(
            self._engines(),
            self,
            lambda engine: (
                f"{type(self).__name__} (owner {self.owner}) committed its version "
                f"{version} into {type(engine).__name__} at {id(engine):#x}, which now "
                "serves its weights"
            ),
        )

    def _publish_committed(self, version: int, moved: Any, start: float, pause_s: float) -> None:
        """COMMITTED (bytes, time, pause window, delta, what went unverified), then
        ENGINE_JOINED for each engine a fleet took in during the sync."""
        self._events.publish(
            VersionEventKind.COMMITTED,
            version,
            nbytes=moved.nbytes if isinstance(moved, Transferred) else moved,
            duration_s=time.perf_counter() - start,
            pause_s=pause_s,
            delta=isinstance(moved, Transferred) and moved.delta,
            unverified=moved.unverified if isinstance(moved, Transferred) else (),
        )
        fleet = elastic_fleet(self)
        for label in fleet.take_joined() if fleet is not None else ():
            self._events.publish(VersionEventKind.ENGINE_JOINED, version, engine=label)

    def _drives_generation(self) -> bool:
        """Whether this process pauses, wakes and labels the engine around a sync
        (one rank of a sharded trainer does): ``ranks.drives_generation``."""
        return self.ranks.drives_generation

    def _pausable(self) -> PausableEngine | None:
        """The engine when this process should pause it, else None."""
        if self._drives_generation() and implements(self.generation, PausableEngine):
            return self.generation
        return None

    async def _label_engine(self, version: int) -> None:
        """The one place where the engine learns its version: once ``version``
        landed on every worker, it labels what it generates with it. Shielded: a
        cancellation must not leave it labelling the new weights with the old version
        (and from here on a failure no longer puts the previous version back)."""
        self._labelling = True
        if self._drives_generation() and implements(self.generation, VersionedEngine):
            with anyio.CancelScope(shield=True):
                await self.generation.on_weights_committed(version)

    async def _resume_after(self, paused_at: float | None, *, failed: bool) -> float:
        """Resume the engine if this sync paused it; returns the pause window, seconds.

        Shielded from cancellation and bounded by ``timeouts.resume_s``
        (``timeouts.after_failure_s`` when ``failed``). After a failed sync an
        error of the resume is logged, not raised, so that the sync's own error
        is the one the caller sees.
        """
        if paused_at is None:
            return 0.0
        limit = self.timeouts.after_failure_s if failed else self.timeouts.resume_s
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(limit):
                if implements(self.generation, PausableEngine):
                    await self.generation.resume_generation()
        except Exception as exc:
            if not failed:
                if isinstance(exc, TimeoutError):
                    raise SyncTimeoutError(
                        f"the engine did not resume generation within {limit} s after the sync"
                    ) from exc
                raise
            # A secondary failure: the sync's own error carries the story; one line here.
            _log.error("resuming generation after a failed sync: %s: %s", type(exc).__name__, exc)
        return time.perf_counter() - paused_at

    def _colocated_refit(
        self, engines: Sequence[Any] | None = None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """The colocated bracket around a transfer (:func:`aiosync._colocated.colocated_refit`)."""
        return colocated_refit(self, engines)

    async def _wake_engines(self, tag: str, engines: Sequence[Any] | None = None) -> None:
        """Wake ``tag`` on each engine that may have released it
        (:func:`aiosync._colocated.wake_engines`)."""
        await wake_engines(self, tag, engines)

    def _live_weights_wrong(self) -> None:
        """:meth:`verify_engine` found a worker's live weights differ from the trainer's:
        stale until a sync lands, and that sync is full (patches applied to corrupted
        weights would keep the corruption)."""
        self._invalidate_engine_weights()
        if self.delta is not None:
            self.delta.invalidate()

    async def verify_engine(self) -> dict[str, int]:
        """Check that every worker computes with what the trainer holds, moving no weights.

        Each worker hashes (SHA-256) the weights it holds as the engine computes with
        them, read back (``aiosync_weight_digests``: the embedded engine's weights,
        vLLM's layers through their kernels; a tensor-parallel rank its part, from the
        engine's :class:`~aiosync.capabilities.LayoutReporting` layout), and the trainer
        hashes the same parts of what its source yields now. Run it when not stale
        (after a sync) to catch what a sync or anything after it left wrong
        (slime's ``--check-weight-update-equal``). Waits for a running sync; the
        source is read under the source lock, as a sync reads it.

        Then an engine that records its own checksums at each commit
        (:class:`~aiosync.capabilities.ChecksumVerifying`: vLLM's ``/weight_checker``
        with ``record_checksums=True``) compares them with its weights now.

        Returns:
            ``{"workers": int, "tensors": int, "checksummed": int, "version":
            weight_version}`` (``checksummed``: tensors the engines' own checksums
            matched, 0 where none recorded).

        Raises:
            RefitVerificationError: a worker's tensor differs (the first one named,
                with the worker), a worker lacks a tensor, or an engine's own checksum
                of a tensor changed since the commit. The synchronizer is then
                stale (:attr:`is_stale`) and its next sync is a full one, also with
                ``delta=True``: it rewrites every tensor, healing the corruption.
            TypeError: the engine has no ``collective_rpc`` (:class:`EngineWorkers`).
            NotImplementedError: a transport without ``capabilities.verify_engine``, or a
                sharded trainer (every rank holds a shard); nothing is compared.
        """
        return await verify_live(self)

    async def shutdown(self) -> None:
        """Close the transport (its ``close``), release everything and end every event
        subscription. Idempotent."""
        try:
            await self.transport.close(self)
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        for notifier in self._notifiers:
            notifier.remove_weights_discarded_listener(self._invalidate_engine_weights)
        self._notifiers = []
        if self.delta is not None:
            self.delta.close()
        self._events.close()

    def subscribe(self, max_backlog: int | None = None) -> EventSubscription:
        """Subscribe to the weight-version event stream (see :mod:`aiosync.events`).

        Args:
            max_backlog: unread events kept before an ``OVERFLOW`` event
                replaces the rest; default ``event_backlog``.
        """
        return self._events.subscribe(self._event_backlog if max_backlog is None else max_backlog)

    def _check_open(self) -> None:
        if self._closed:
            raise SyncError(f"{type(self).__name__} was shut down")

    async def __aenter__(self) -> Self:
        """Initialize (:meth:`init_communicator`, unless already done); a set-up
        error shuts the synchronizer down and propagates from the ``async with``."""
        if not self._initialized:
            try:
                await self.init_communicator()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.shutdown()
                raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()
