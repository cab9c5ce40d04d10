"""The abstract interfaces: the synchronizer, the trainer's refit source, the engine.

:class:`WeightSynchronizer` plays the role of httpx's ``AsyncBaseTransport``:
each transport (``transports/collective.py``, ``ipc.py``, ``http.py``)
implements one method, :meth:`WeightSynchronizer._transfer`, and the training
loop never asks which one it holds. Version bookkeeping, events, coalescing
and timeouts live here, once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, get_args, runtime_checkable

import anyio

from ._config import DEFAULT_EVENT_BACKLOG, DEFAULT_SYNC_TIMEOUT_S
from .errors import SyncError, SyncTimeoutError
from .events import EventSubscription, VersionEventKind, _EventHub

if TYPE_CHECKING:
    import torch

__all__ = [
    "IN_FLIGHT_POLICIES",
    "EngineWorkers",
    "GenerationBackend",
    "InFlightPolicy",
    "KVScales",
    "RefitManifest",
    "RefitSource",
    "TrainCluster",
    "WeightSynchronizer",
    "refit_if_stale",
]

#: ``{hf_name: (shape, dtype)}`` in the order the source yields the tensors.
RefitManifest = dict[str, tuple[tuple[int, ...], "torch.dtype"]]

#: FP8 KV-cache scales: ``{layer_index_or_name: scale}`` (a float per layer).
KVScales = Mapping[str | int, float]

#: What a sync does with the requests the engine is generating when it starts
#: (see :class:`GenerationBackend`'s ``pause_generation``): ``"abort"`` ends them
#: now, ``"wait"`` lets them finish first, ``"keep"`` freezes them and lets the
#: new weights compute their remaining tokens.
InFlightPolicy = Literal["abort", "wait", "keep"]

#: The values of :data:`InFlightPolicy`, in that order.
IN_FLIGHT_POLICIES: tuple[InFlightPolicy, ...] = get_args(InFlightPolicy)

#: Limit for the engine's ``resume_generation`` after a sync, seconds (it also
#: runs after a failed or cancelled sync, shielded, so it must be bounded).
DEFAULT_RESUME_TIMEOUT_S: float = 30.0
#: The same limit after a failed or cancelled sync, seconds: a healthy engine resumes
#: in milliseconds, and a hung one must not delay the sync's own error by
#: :data:`DEFAULT_RESUME_TIMEOUT_S` (the fault matrix saw 5 + 30 s for an SGLang
#: server stopped mid-sync).
RESUME_AFTER_FAILURE_TIMEOUT_S: float = 2.0

_log = logging.getLogger(__name__)


@runtime_checkable
class RefitSource(Protocol):
    """The trainer's side of every transport: its weights as the HF state dict.

    Names and shapes are those of the model's HF safetensors checkpoint (what
    ``save_pretrained`` writes and what the engine's ``load_weights`` takes),
    not the trainer's in-memory layout. Implementations: ``aiosync.refit.DTensorRefitSource``
    (torch, DTensor/FSDP2) and ``aiosync.refit.NNXRefitSource`` (JAX/flax NNX).
    Subclass this protocol explicitly to inherit the no-op offload hooks.
    """

    def prepare_refit_info(self) -> RefitManifest:
        """Return ``{hf_name: (shape, dtype)}``, ordered, identical on every rank."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full, unsharded tensors in exactly the manifest's order, shape and dtype.

        On a sharded trainer every rank must iterate (gathers are collectives);
        only the source rank's tensors are sent.
        """
        ...

    def offload_before_refit(self) -> None:
        """Colocated only: free device memory (optimizer state) before the refit."""
        return None

    def offload_after_refit(self) -> None:
        """Colocated only: undo :meth:`offload_before_refit` after the refit, even on failure."""
        return None


@runtime_checkable
class GenerationBackend(Protocol):
    """The inference engine as the training loop sees it (vLLM, SGLang, embedded)."""

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine: ``tags`` selects ``"weights"`` and/or ``"kv_cache"`` (None: all)."""
        ...

    async def finish_generation(self) -> None:
        """Let the engine release device memory while the trainer runs (sleep)."""
        ...

    # Optional: ``async def on_weights_committed(self, version: int) -> None``, called
    # by the synchronizer once ``version`` landed on every worker, so that the engine
    # reports (and labels its outputs with) the synchronizer's ``weight_version``.
    #
    # Optional, the in-flight policy (vLLM's pause_generation/resume_generation,
    # SGLang's /pause_generation and /continue_generation); the synchronizer calls
    # them around every sync when the engine has them:
    #
    # ``async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True)
    # -> None``: stop admitting new requests (they wait until resumed), then, for the
    # requests already running:
    #   * ``"abort"``: end them now with the tokens they have, marked aborted;
    #     return once they ended;
    #   * ``"wait"``: let them run to their end; return once they finished;
    #   * ``"keep"``: freeze them in place (between two tokens); return once no
    #     forward pass runs. After ``resume_generation`` they continue, their
    #     remaining tokens computed by the weights live then.
    # ``clear_cache``: also drop the engine's prefix/KV cache of finished requests
    # (computed by the old weights). Raises ValueError for an unknown mode.
    #
    # ``async def resume_generation(self) -> None``: admit requests again and let
    # frozen ones continue. Idempotent (called after failed syncs too).
    #
    # Generation, the same keywords on every engine (embedded, vLLM, SGLang, a fleet),
    # so that one rollout loop drives any of them unchanged:
    #
    # ``async def generate_with_meta(self, prompts: Sequence[Sequence[int]], *,
    # max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
    # seed: int | None = None, ignore_eos: bool = False, logprobs: bool = False)
    # -> list[aiosync.Generation]``: one :class:`~aiosync.Generation` per prompt
    # (token ids, each ``[len(prompt)]`` ints), in prompt order: the new token
    # ids; with ``logprobs=True`` each sampled token's natural-log probability
    # under the raw (pre-temperature) distribution, float32 precision (vLLM's
    # default ``raw_logprobs``); the weight versions that computed them
    # (``first_version``, ``last_version``, ``version_change_at``), ``aborted``
    # and ``finish_reason``. Greedy when ``temperature == 0``; ``seed`` makes
    # sampling reproducible on one engine (not across engines); ``ignore_eos``
    # generates ``max_new_tokens`` tokens whatever is sampled. Raises
    # ValueError for ``max_new_tokens < 1``, ``temperature < 0`` or ``top_p``
    # outside ``(0, 1]``; SyncError while the engine's weights are not valid.


@runtime_checkable
class EngineWorkers(Protocol):
    """An engine whose workers can be driven by name, like vLLM's ``collective_rpc``."""

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every worker; one result per worker, rank order."""
        ...


@dataclass(frozen=True, slots=True)
class TrainCluster:
    """Where the trainer's ranks are, and where a non-colocated sync group meets.

    Attributes:
        world_size: trainer ranks taking part in the refit (all gather; rank 0 sends).
        rank: this process's rank among them.
        master_addr: host of the sync group's ``TCPStore`` (loopback in tests).
        master_port: its TCP port, bound by trainer rank 0. ``0`` (the default):
            rank 0 lets the OS pick a free port, logs it and exposes it as the
            synchronizer's ``master_port``, and passes it to the engine's workers.
            Only with ``world_size == 1``: the other trainer ranks cannot learn a
            port rank 0 has not bound yet, so with several ranks pick one port
            (as for ``MASTER_PORT``) and give it to every rank.

    Raises:
        ValueError: ``master_port`` outside ``0..65535``, or ``0`` with ``world_size > 1``.
        TypeError: ``master_port`` is not an int.
    """

    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
            raise TypeError(f"master_port must be an int, got {type(self.master_port).__name__}")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if self.master_port == 0 and self.world_size > 1:
            raise ValueError(
                f"master_port=0 (let rank 0 pick a free port) needs world_size == 1, got "
                f"{self.world_size} ranks, which must all be told the same port: choose one "
                "(as for MASTER_PORT) and pass it to every rank"
            )


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


class WeightSynchronizer(ABC):
    """Moves the trainer's weights to every generation worker, one version at a time.

    The loop's handshake: after each optimizer step ``await mark_stale()``;
    before generating, if :attr:`is_stale`, ``await sync_weights()`` then
    ``await generation.prepare_for_generation()`` (see :func:`refit_if_stale`).

    Versions: :attr:`policy_version` is the trainer's latest (starts 0),
    :attr:`weight_version` the version live on **all** workers (starts 0). Both
    only go up. A failed or cancelled sync leaves :attr:`weight_version`
    unchanged and :attr:`is_stale` true.

    Subclasses implement :meth:`_transfer` and may extend :meth:`init_communicator`
    and :meth:`shutdown` (calling ``super()``).

    In-flight requests (case C13): when the engine has ``pause_generation`` (see
    :class:`GenerationBackend`), every sync pauses it with ``in_flight`` before
    the first byte reaches it, and resumes it once the version committed, or
    failed, or was cancelled. A request the engine is generating meanwhile is
    never computed by a mix of two weight sets without saying so: ``"wait"``
    (the default) finishes it on the old weights first, ``"abort"`` ends it
    (marked aborted), ``"keep"`` continues it on the new ones afterwards.

    Args:
        policy: the trainer's :class:`RefitSource`.
        generation: the engine (a :class:`GenerationBackend`).
        sync_timeout_s: limit for a whole ``sync_weights`` call, seconds (the
            pause, a ``"wait"`` for running requests included).
        event_backlog: default ``max_backlog`` of :meth:`subscribe`, in events.
        in_flight: the default :data:`InFlightPolicy` of :meth:`sync_weights`.

    Raises:
        ValueError: ``sync_timeout_s`` not finite and > 0, ``event_backlog < 1``,
            or ``in_flight`` not one of :data:`IN_FLIGHT_POLICIES`.
        TypeError: ``event_backlog`` is not an int.
    """

    def __init__(
        self,
        policy: RefitSource,
        generation: Any,
        *,
        sync_timeout_s: float = DEFAULT_SYNC_TIMEOUT_S,
        event_backlog: int = DEFAULT_EVENT_BACKLOG,
        in_flight: InFlightPolicy = "wait",
    ) -> None:
        _check_in_flight(in_flight)
        if not (isinstance(sync_timeout_s, int | float) and 0 < sync_timeout_s < math.inf):
            raise ValueError(f"sync_timeout_s must be a finite number > 0, got {sync_timeout_s!r}")
        if isinstance(event_backlog, bool) or not isinstance(event_backlog, int):
            raise TypeError(f"event_backlog must be an int, got {type(event_backlog).__name__}")
        if event_backlog < 1:
            raise ValueError(f"event_backlog must be >= 1, got {event_backlog}")
        self.policy = policy
        self.generation = generation
        self.sync_timeout_s = sync_timeout_s
        #: What :meth:`sync_weights` does with requests in flight (its default).
        self.in_flight: InFlightPolicy = in_flight
        self._event_backlog = event_backlog
        self._policy_version = 0
        self._weight_version = 0
        # True when the engine may hold weights that are not ``weight_version``
        # (a sync failed half-way, or the engine discarded its weights).
        self._engine_dirty = False
        # Counts the engine's weight discards, so that one during a sync is not
        # cleared by that sync's success.
        self._discards = 0
        self._initialized = False
        self._closed = False
        self._lock = anyio.Lock()
        # Held while a sync reads the source and while the trainer updates it
        # (policy_update): a version is one consistent set of weights.
        self._source_lock = anyio.Lock()
        self._events = _EventHub(lambda: (self._policy_version, self._weight_version))

    # -- versions -------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The trainer's latest weight version (starts 0)."""
        return self._policy_version

    @property
    def weight_version(self) -> int:
        """The version live on all generation workers (starts 0)."""
        return self._weight_version

    @property
    def is_stale(self) -> bool:
        """True when the engine must be refit before it generates.

        ``policy_version > weight_version``, or the engine's weights are not
        trustworthy (a sync failed half-way, or the engine discarded them).
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
        """For transports: the engine no longer holds ``weight_version`` (e.g. woken
        after discarding its weights); a sync is required before it generates.
        A sync in flight when this happens fails instead of committing."""
        self._engine_dirty = True
        self._discards += 1

    # -- lifecycle ------------------------------------------------------------

    async def init_communicator(self) -> None:
        """Set up the transport, once, after the engine's workers exist.

        Subclasses override it (prepare the manifest, open sockets, form the
        group) and call ``await super().init_communicator()`` last.
        """
        self._check_open()
        self._initialized = True

    async def sync_weights(
        self, kv_scales: KVScales | None = None, *, in_flight: InFlightPolicy | None = None
    ) -> None:
        """Move the weights of the current ``policy_version`` to every worker.

        A call made while another sync runs waits for it, then syncs again only
        if still stale. Not stale: returns at once (the engine is not paused).

        When the engine has ``pause_generation``, the sync pauses it with the
        in-flight policy before the first byte reaches it and resumes it after
        the version committed, and after a failure or cancellation too (shielded,
        bounded by :data:`DEFAULT_RESUME_TIMEOUT_S`, after a failure by
        :data:`RESUME_AFTER_FAILURE_TIMEOUT_S`; a resume error is logged and never
        hides the sync's own). The pause window, seconds, is the
        ``pause_s`` of the ``COMMITTED``/``FAILED`` event.

        Args:
            kv_scales: FP8 KV-cache scales ``{layer_index_or_name: float}``,
                loaded as the engine's ``model.layers.{i}.self_attn.{k,v}_scale``.
            in_flight: this call's :data:`InFlightPolicy`; None: :attr:`in_flight`.

        Raises:
            TypeError, ValueError: malformed ``kv_scales``, or an ``in_flight``
                that is not one of :data:`IN_FLIGHT_POLICIES` (before anything moves).
            SyncTimeoutError: the sync (the pause included) ran past
                ``sync_timeout_s`` seconds.
            RefitMismatchError, TransportError: from the transport, or from the
                engine's ``pause_generation`` (the sync then fails, and the engine
                is resumed).
            SyncError: not initialized, or shut down, or the engine discarded its
                weights while the sync ran (sync again).
            Whatever the engine's ``resume_generation`` raised after the version
                committed (``weight_version`` has advanced; the engine may still
                be paused: call its ``resume_generation``).
        """
        policy = _check_in_flight(self.in_flight if in_flight is None else in_flight)
        _check_kv_scales(kv_scales)
        self._check_open()
        if not self._initialized:
            raise SyncError("await init_communicator() before sync_weights()")
        # The version is read under the source lock: a policy_update in progress
        # finishes first, and the sync then moves (and names) the updated weights.
        async with self._lock, self._source_lock:
            self._check_open()
            if not self.is_stale:
                return
            version = self._policy_version
            discards = self._discards
            self._events.publish(VersionEventKind.SYNC_STARTED, version)
            start = time.perf_counter()
            paused_at: float | None = None
            try:
                with anyio.fail_after(self.sync_timeout_s):
                    pause = self._pause_method()
                    if pause is not None:
                        # Set before the call: a pause that fails half-way (some
                        # engines of a fleet paused) is resumed all the same.
                        paused_at = time.perf_counter()
                        await pause(policy, clear_cache=True)
                    nbytes = await self._transfer(version, kv_scales)
                if self._discards != discards:
                    raise SyncError(
                        f"the engine discarded its weights while version {version} was being "
                        "synced: some workers may hold neither version; sync again"
                    )
                # The engine labels what it generates from now on with this version.
                committed = getattr(self.generation, "on_weights_committed", None)
                if committed is not None:
                    with anyio.CancelScope(shield=True):
                        await committed(version)
            except BaseException as exc:
                self._engine_dirty = True
                pause_s = await self._resume_after(paused_at, failed=True)
                self._events.publish(
                    VersionEventKind.FAILED,
                    version,
                    duration_s=time.perf_counter() - start,
                    error=repr(exc),
                    pause_s=pause_s,
                )
                if isinstance(exc, TimeoutError) and not isinstance(exc, SyncTimeoutError):
                    raise SyncTimeoutError(
                        f"sync of version {version} exceeded {self.sync_timeout_s} s"
                    ) from exc
                raise
            self._weight_version = max(self._weight_version, version)
            self._engine_dirty = False
            resume_error: BaseException | None = None
            try:
                pause_s = await self._resume_after(paused_at, failed=False)
            except Exception as exc:
                resume_error = exc
                pause_s = time.perf_counter() - paused_at if paused_at is not None else 0.0
            self._events.publish(
                VersionEventKind.COMMITTED,
                version,
                nbytes=nbytes,
                duration_s=time.perf_counter() - start,
                pause_s=pause_s,
            )
            if resume_error is not None:
                raise resume_error

    def _drives_generation(self) -> bool:
        """Whether this process pauses and resumes the engine around a sync: True
        here; a transport of a sharded trainer overrides it so that only the rank
        that drives the engine does."""
        return True

    def _pause_method(self) -> Any:
        """The engine's ``pause_generation`` when this process should call it, else None."""
        if self.generation is None or not self._drives_generation():
            return None
        pause = getattr(self.generation, "pause_generation", None)
        return pause if callable(pause) else None

    async def _resume_after(self, paused_at: float | None, *, failed: bool) -> float:
        """Resume the engine if this sync paused it; returns the pause window, seconds.

        Shielded from cancellation and bounded by :data:`DEFAULT_RESUME_TIMEOUT_S`
        (:data:`RESUME_AFTER_FAILURE_TIMEOUT_S` when ``failed``).
        After a failed sync (``failed``) an error of the resume is logged, not
        raised, so that the sync's own error is the one the caller sees.
        """
        if paused_at is None:
            return 0.0
        resume = getattr(self.generation, "resume_generation", None)
        try:
            limit = RESUME_AFTER_FAILURE_TIMEOUT_S if failed else DEFAULT_RESUME_TIMEOUT_S
            with anyio.CancelScope(shield=True), anyio.fail_after(limit):
                if callable(resume):
                    await resume()
        except Exception as exc:
            if not failed:
                if isinstance(exc, TimeoutError):
                    raise SyncTimeoutError(
                        f"the engine did not resume generation within "
                        f"{DEFAULT_RESUME_TIMEOUT_S} s after the sync"
                    ) from exc
                raise
            _log.exception("resuming generation after a failed sync")
        return time.perf_counter() - paused_at

    @abstractmethod
    async def _transfer(self, version: int, kv_scales: KVScales | None) -> int:
        """Move the weights of ``version`` to every worker; return the bytes moved.

        Raise on any failure; the base class keeps the versions consistent.
        """

    async def shutdown(self) -> None:
        """Release everything and end every event subscription. Idempotent.

        Subclasses release their own resources, then ``await super().shutdown()``.
        """
        self._closed = True
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
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()


async def refit_if_stale(
    sync: WeightSynchronizer, generation: GenerationBackend | None = None
) -> bool:
    """The loop's handshake before generating.

    If ``sync.is_stale``: ``await sync.sync_weights()`` then
    ``await generation.prepare_for_generation()``. Returns whether it refit.
    Errors of ``sync_weights`` propagate and ``prepare_for_generation`` is
    then not called, so the engine never generates with half-updated weights.

    Args:
        generation: the engine to wake; default ``sync.generation`` (the engine,
            or the :class:`~aiosync.EngineFleet` a list of engines became).

    Raises:
        TypeError: ``generation`` has no ``prepare_for_generation`` (e.g. a plain
            list of engines), before anything is synced.
    """
    if generation is None:
        generation = sync.generation
    if not callable(getattr(generation, "prepare_for_generation", None)):
        raise TypeError(
            f"generation must be an engine with prepare_for_generation, got "
            f"{type(generation).__name__}; for a fleet pass sync.generation (or omit it)"
        )
    if not sync.is_stale:
        return False
    await sync.sync_weights()
    await generation.prepare_for_generation()
    return True
