"""Non-colocated transport: packed, pipelined broadcast from the trainer to every worker.

The trainer (``T`` ranks) and the engine (``W`` workers) run on separate devices
or machines. :class:`CollectiveWeightSynchronizer` forms a dedicated
torch.distributed group (:mod:`aiosync.transports.collective._group`: NCCL on CUDA,
gloo on CPU) and,
per sync, broadcasts the manifest's packed buckets (:mod:`aiosync.transports.packing`)
from trainer rank 0. Of the engine's sleep it wakes the weights only, before the
first byte is loaded into them (the KV cache is ``prepare_for_generation()``'s).

Timeline of one sync (in-place)::

    trainer rank 0      header | pack 0 | pack 1, send 0 | pack 2, send 1 | ... | trailer | vote
    inference ranks     header | recv 0 | recv 1, load 0 | recv 2, load 1 | ... | trailer | vote

With ``verify`` (default ``True``: every byte) the source digests each bucket as it
packs it, the trailer carries the digests, and every worker compares them with its own
digests of what it received before the vote: a mismatch fails the vote on every
rank as :class:`~aiosync.errors.RefitVerificationError`, so no worker counts its
weights valid (``docs/reliability.md``).

With ``overlap="staged"`` the workers receive into a staging area in a
background thread while they keep generating, and pause generation only for
the final copy into the live weights (``aiosync_collective_commit``). No RPC
of theirs is in flight meanwhile, so the source asks the engine every 0.25 s
whether a worker died (its ``check_health``) and, if one did, aborts the group and
fails the sync naming it, as the in-place receive's RPC would.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import anyio.to_thread
import torch

from aiosync._config import DEFAULT_BUCKET_BYTES, DEFAULT_EVENT_BACKLOG, Timeouts
from aiosync._delta_refit import DeltaRefit
from aiosync._fanout import most_telling
from aiosync.capabilities import EngineWorkers, HealthReporting, InFlightPolicy, WorkerDescribing
from aiosync.cluster import TrainCluster
from aiosync.delta import DeltaBaseline
from aiosync.errors import SyncError, SyncTimeoutError, TransportError
from aiosync.options import TransportCapabilities
from aiosync.sources import RefitSource
from aiosync.synchronizer import KVScales, Transferred, WeightSynchronizer

from .._verify import Verify, check_verify
from ..packing import BucketPlan, group_by_bucket, plan_buckets, plan_patches
from ._group import STATUS_OK, SyncGroup, cancel_formation, create_sync_group, open_store
from ._loops import RotatingBuffers, SendResult, stream_buckets, vote_send
from ._votes import GroupRanks, Heartbeat, SyncRounds, SyncVotes, agree_formation
from ._wire import kv_scale_entries

__all__ = [
    "DIST_BACKENDS",
    "CollectiveWeightSynchronizer",
    "DistBackend",
    "default_bucket_bytes",
    "kv_scale_entries",
]

#: The torch.distributed backends of the data group (``dist_backend=``).
DistBackend = Literal["nccl", "gloo"]
DIST_BACKENDS: tuple[DistBackend, ...] = ("nccl", "gloo")

_T = TypeVar("_T")

_log = logging.getLogger(__name__)

#: Cap of the GPU default bucket size, bytes (NeMo-RL's choice).
_MAX_GPU_BUCKET_BYTES = 5 * 1024**3
#: With ``overlap="staged"``, how often the source asks the engine whether a worker
#: died while it sends (its ``check_health``), seconds.
_ENGINE_WATCH_S = 0.25
#: How long a staged source whose collective failed waits for the engine to report a
#: dead worker (the cause it names in place of gloo's error), seconds.
_DEATH_NOTICE_S = 1.0


def default_bucket_bytes(device: torch.device) -> int:
    """The default bucket size, bytes: ``min(2 % of device memory, 5 GiB)`` on a
    visible CUDA device, :data:`aiosync.DEFAULT_BUCKET_BYTES` (512 MiB) otherwise."""
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        return min(total // 50, _MAX_GPU_BUCKET_BYTES)
    return DEFAULT_BUCKET_BYTES


def _data_device(dist_backend: DistBackend) -> torch.device:
    """Where the bucket buffers live: the current CUDA device for nccl (``cuda``
    unindexed when none is visible: the group cannot form then), else the CPU."""
    if dist_backend != "nccl":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda")


class _ClusterRanks:
    """The collective's trainer ranks as the synchronizer asks them
    (:class:`~aiosync.cluster.Ranks`): the source (rank 0) alone drives the engine,
    and the ranks gather over their control group."""

    def __init__(self, sync: CollectiveWeightSynchronizer) -> None:
        self._sync = sync
        self.rank = sync.train_cluster.rank
        self.sharded = sync.train_cluster.world_size > 1

    @property
    def drives_generation(self) -> bool:
        # Only the source drives the engine; the other trainer ranks never call it.
        return self._sync.is_source

    async def gather(self, obj: Any) -> list[Any] | None:
        # Over the trainer ranks' control group; none while it is being re-formed
        # (after a failure), when each rank answers for itself.
        trainers = self._sync._trainers
        if trainers is None or trainers.broken:
            return None
        ranks = GroupRanks(trainers)
        with anyio.CancelScope(shield=True):  # a cancelled rank still answers
            gathered = await ranks.all_gather(obj)
        return gathered


class CollectiveWeightSynchronizer(WeightSynchronizer):
    """Broadcasts the trainer's weights to a separate inference cluster.

    Every trainer rank constructs one and calls the same methods (SPMD): all
    ranks iterate ``policy.iter_weights()`` (gathers are collectives); rank 0
    sends and drives the engine's workers through ``generation.collective_rpc``.
    The workers must mix in :class:`~aiosync.transports.collective.worker.CollectiveWorkerMixin`
    (``aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension`` for vLLM).

    The engine's session holds the source (trainer rank 0, session rank 0) and
    the inference workers (session ranks ``1..W``), as vLLM's weight-transfer API
    does; with several trainer ranks the others take part in the gathers only
    and agree on every outcome with the source (a formation's in a control-only
    gloo group of the trainer ranks, a sync's over the store, so that a rank that
    failed or died mid-gather is named within ``sync_timeout_s``: see
    :mod:`~aiosync.transports.collective._votes`), so that versions, ``is_stale``
    and events are identical on every rank and a failure anywhere is the same
    error everywhere. The store
    lives on trainer rank 0 at ``train_cluster.master_addr:master_port`` (port 0:
    one the OS picks, logged and readable as :attr:`master_port`). Rank 0 binds
    it before it asks the workers to join, so a port in use is a
    :class:`~aiosync.errors.TransportError` at once.

    Args:
        policy: the trainer's refit source (HF checkpoint names and layout).
        generation: the engine; an :class:`aiosync.EngineWorkers` (used on rank 0 only).
        train_cluster: trainer ranks and the sync group's meeting point.
        inference_world_size: number of engine workers ``W`` (>= 1).
        dist_backend: the data group's torch.distributed backend, ``"nccl"`` or
            ``"gloo"``; None: nccl when CUDA is available, else gloo. An NCCL
            synchronizer can be built without a GPU; its ``init_communicator()``
            then raises TransportError.
        bucket_bytes: bucket size, bytes; default :func:`default_bucket_bytes`.
            Two buffers of this size are allocated on each side.
        verify: check every bucket each worker received against what the source
            sent (:mod:`aiosync.transports._verify`): ``True`` (the default) digests
            every byte (the block-sum digest, taken while packing, each chunk in cache:
            any single flipped bit is caught), ``"sample"`` every tensor's first and
            last byte plus 4096 bytes in runs of 8 drawn afresh per sync and bucket,
            ``False`` nothing. The digests travel in
            the trailer and each worker compares before the vote: a mismatch
            fails the sync with :class:`~aiosync.errors.RefitVerificationError`
            naming the worker, the bucket and its first tensor, before any worker
            counts its weights valid (in-place: the engine refuses to generate
            until a sync lands; staged: the live weights are left as they were).
        overlap: ``"inplace"`` (load each bucket as it lands) or ``"staged"``
            (receive everything into a staging copy while generating, then pause
            only for the final copy; costs one extra copy of the weights on each worker).
        delta: send, per tensor, only the elements whose bits changed since the
            last version committed on every worker, in the smallest encoding for
            that tensor and sync (:mod:`aiosync.delta`; never more bytes than a
            full sync); the workers write the patches in place. Costs one host
            copy of the weights on trainer rank 0 (the baseline; two during a full
            sync). The first sync, and any after a failed or cancelled one, a
            worker that does not hold the baseline (respawned, discarded weights,
            a new group) or a new engine, is a full one. With ``overlap="staged"``
            the workers stage the patches' wire buckets (their size, not the
            weights') and write them at the commit. With several trainer ranks
            every rank gathers as for a full sync (rank 0 diffs what it gathered).
        timeouts: every limit (:class:`~aiosync.Timeouts`); ``rpc_s`` bounds each
            control RPC to the workers.
        rpc_timeout_s: overrides ``timeouts.rpc_s``, seconds.
        collective_timeout_s: limit of the rendezvous and of every collective,
            seconds (torch's process-group timeout; a dead rank surfaces within
            it); default ``timeouts.rpc_s``.
        sync_timeout_s: overrides ``timeouts.sync_s``: a whole ``sync_weights`` call, seconds.
        event_backlog: default ``max_backlog`` of :meth:`subscribe`, in events.
        in_flight: the default in-flight policy of ``sync_weights``.
        initial_version: where both versions start (a trainer resumed from its
            step-N checkpoint passes N); see :class:`~aiosync.WeightSynchronizer`.
        backend: deprecated name of ``dist_backend`` (DeprecationWarning).

    Raises:
        ValueError: an option is out of range, ``dist_backend`` is not
            ``"nccl"``, ``"gloo"`` or None, or ``verify`` is not True, False
            or ``"sample"``.
        TypeError: ``train_cluster`` is not a :class:`~aiosync.TrainCluster`.
    """

    #: What it can do, as data (:class:`~aiosync.TransportCapabilities`): the factory
    #: refuses a shared option outside it; the conformance kit runs its cells.
    capabilities = TransportCapabilities(
        verify=frozenset({False, "sample", True}),
        delta=True,
        elastic=True,
        sharded_trainer=True,
        verify_engine=True,
    )

    #: The workers' RPC that leaves and destroys the sync group.
    _destroy_rpc: ClassVar[str] = "aiosync_collective_destroy"

    def __init__(
        self,
        policy: RefitSource,
        generation: EngineWorkers | Any,
        *,
        train_cluster: TrainCluster,
        inference_world_size: int,
        dist_backend: DistBackend | None = None,
        bucket_bytes: int | None = None,
        verify: Verify = True,
        overlap: Literal["inplace", "staged"] = "inplace",
        delta: bool = False,
        timeouts: Timeouts | None = None,
        rpc_timeout_s: float | None = None,
        collective_timeout_s: float | None = None,
        sync_timeout_s: float | None = None,
        event_backlog: int = DEFAULT_EVENT_BACKLOG,
        in_flight: InFlightPolicy = "wait",
        initial_version: int = 0,
        backend: DistBackend | None = None,
    ) -> None:
        if backend is not None:
            warnings.warn(
                "CollectiveWeightSynchronizer(backend=...) is now dist_backend=...",
                DeprecationWarning,
                stacklevel=2,
            )
            if dist_backend is None:
                dist_backend = backend
        if dist_backend is not None and dist_backend not in DIST_BACKENDS:
            raise ValueError(f"dist_backend must be 'nccl', 'gloo' or None, got {dist_backend!r}")
        verify = check_verify(verify)
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise TypeError(f"timeouts must be an aiosync.Timeouts, got {type(timeouts).__name__}")
        super().__init__(
            policy,
            generation,
            timeouts=(timeouts or Timeouts()).with_keywords(rpc_timeout_s=rpc_timeout_s),
            sync_timeout_s=sync_timeout_s,
            event_backlog=event_backlog,
            in_flight=in_flight,
            initial_version=initial_version,
        )
        if not isinstance(train_cluster, TrainCluster):
            raise TypeError(
                f"train_cluster must be an aiosync.TrainCluster, got {type(train_cluster).__name__}"
            )
        if not 0 <= train_cluster.rank < train_cluster.world_size:
            raise ValueError(
                f"train_cluster.rank {train_cluster.rank} outside 0..{train_cluster.world_size - 1}"
            )
        if inference_world_size < 1:
            raise ValueError(f"inference_world_size must be >= 1, got {inference_world_size}")
        if dist_backend is None:
            dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if overlap not in ("inplace", "staged"):
            raise ValueError(f"overlap must be 'inplace' or 'staged', got {overlap!r}")
        if collective_timeout_s is not None and not 0 < collective_timeout_s < float("inf"):
            raise ValueError(
                f"collective_timeout_s must be a finite number > 0, got {collective_timeout_s}"
            )
        self.train_cluster = train_cluster
        self.ranks = _ClusterRanks(self)
        self.inference_world_size = inference_world_size
        #: The data group's backend, ``"nccl"`` or ``"gloo"``.
        self.dist_backend: DistBackend = dist_backend
        self.device = _data_device(dist_backend)
        self.bucket_bytes = (
            bucket_bytes if bucket_bytes is not None else default_bucket_bytes(self.device)
        )
        #: The per-bucket check (``True``, ``"sample"`` or ``False``); may be changed
        #: between syncs.
        self.verify: Verify = verify
        self.overlap = overlap
        self.delta = DeltaRefit(DeltaBaseline()) if delta else None
        #: Limit of the rendezvous and of every collective, seconds.
        self.collective_timeout_s = (
            collective_timeout_s if collective_timeout_s is not None else self.timeouts.rpc_s
        )
        self._plan: BucketPlan | None = None
        self._group: SyncGroup | None = None
        # The trainer ranks' control-only group (several ranks): agrees on outcomes.
        self._trainers: SyncGroup | None = None
        # Kept for the synchronizer's lifetime (rank 0: the TCPStore server), so
        # re-forming a group never has to bind the port again.
        self._store: Any = None
        self._bound_port: int | None = None
        self._buffers: RotatingBuffers | None = None
        self._sessions = 0
        # The current group session's name and its syncs so far (the trainer ranks'
        # votes of sync n live under aiosync/<session>/trainers/sync/<n> in the store).
        self._session = ""
        self._syncs = 0
        # Several trainer ranks: this rank's liveness in the store (see _votes).
        self._heartbeat: Heartbeat | None = None
        # Keys this synchronizer's group on the engine's workers (see OwnershipError).
        self._owner = secrets.token_hex(8)
        # Set when a thread running collectives is abandoned (timeout/cancel):
        # it then tears the group down itself when it returns.
        self._abandoned = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        #: Per-worker results of the last successful sync (``pause_s``, ``nbytes``...).
        self.last_worker_results: list[dict[str, Any]] = []

    # -- properties ------------------------------------------------------------

    @property
    def rpc_timeout_s(self) -> float:
        """Limit of each control RPC to the workers, seconds (``timeouts.rpc_s``)."""
        return self.timeouts.rpc_s

    @property
    def backend(self) -> DistBackend:
        """Deprecated name of :attr:`dist_backend`."""
        return self.dist_backend

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan of the current group. Raises SyncError before init."""
        if self._plan is None:
            raise SyncError("await init_communicator() first")
        return self._plan

    @property
    def is_source(self) -> bool:
        """True on trainer rank 0, the rank that sends and drives the workers."""
        return self.train_cluster.rank == 0

    @property
    def master_port(self) -> int | None:
        """The sync group's store port: ``train_cluster.master_port``, or, when that is
        0, the port the OS picked on rank 0 (None until ``init_communicator()`` bound it;
        kept after ``shutdown()``)."""
        return self.train_cluster.master_port or self._bound_port

    @property
    def world_size(self) -> int:
        """Ranks of the engine's sync group: the source plus the inference workers (the
        other trainer ranks never join it)."""
        return 1 + self.inference_world_size

    # -- lifecycle -------------------------------------------------------------

    async def open(self, sync: WeightSynchronizer) -> None:
        """Fetch the manifest, form the sync group, compare digests on every rank.

        May be called again to re-form the group (after a failure, or when the
        engine's workers were replaced); the previous group is destroyed first.

        Raises:
            RefitMismatchError: a rank's manifest or plan differs (every rank raises).
            SyncTimeoutError: a rank did not join within ``collective_timeout_s``.
            TransportError: the rendezvous or a worker RPC failed; on rank 0, the
                store's port is in use (raised before any worker is contacted).
                When one side's set-up fails (rank 0's own gloo set-up, e.g. a
                wrong ``GLOO_SOCKET_IFNAME``, or a worker's), the other side is
                cancelled at once: every rank raises within moments, quoting it,
                rather than after the formation limit.
            ValueError: ``inference_world_size`` is not the engine's worker count
                (raised before the rendezvous).
        """
        self._check_open()
        await self._form_group()

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        """The fleet's engines changed: re-form the group over the workers now in the
        sync (global ranks contiguous again; ``inference_world_size`` follows)."""
        workers = await self.generation.collective_rpc(
            "aiosync_device_identity", timeout_s=self.rpc_timeout_s
        )
        self.inference_world_size = len(workers)
        await self.open(sync)

    async def close(self, sync: WeightSynchronizer) -> None:
        """Destroy the sync group (locally and on the workers), then close. Idempotent.

        Works after a failure: a broken group is aborted rather than shut down,
        and an unreachable worker does not stop the local teardown.
        """
        if not self._closed:
            await self._teardown(notify_workers=True)
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            self._store = None

    async def _form_group(self) -> None:
        if self.dist_backend == "nccl" and not torch.cuda.is_available():
            raise TransportError(
                "dist_backend='nccl' needs a CUDA build of torch and a visible GPU; "
                "use dist_backend='gloo' on CPU"
            )
        await self._teardown(notify_workers=False)
        manifest = await self._read_manifest()
        plan = plan_buckets(manifest, self.bucket_bytes)
        self._sessions += 1
        # Identical on every trainer rank: it names the group's keys in the store.
        session = f"{self._sessions}"
        tc = self.train_cluster
        if self.is_source and self._store is None:
            # Bound before any worker is asked to join: a port in use fails now,
            # not after the workers waited the whole formation limit for a
            # rendezvous that cannot happen.
            self._store = await anyio.to_thread.run_sync(
                lambda: open_store(
                    tc.master_addr,
                    tc.master_port,
                    is_master=True,
                    timeout_s=self.collective_timeout_s,
                )
            )
            self._bound_port = int(self._store.port)
            _log.info(
                "sync-group store listening on %s:%d%s",
                tc.master_addr,
                self._bound_port,
                " (picked by the OS: TrainCluster.master_port=0)" if tc.master_port == 0 else "",
            )

        def store() -> Any:
            if self._store is None:
                self._store = open_store(
                    tc.master_addr,
                    tc.master_port,
                    is_master=self.is_source,
                    timeout_s=self.collective_timeout_s,
                )
            return self._store

        def join_trainers() -> SyncGroup | None:
            if tc.world_size == 1:
                return None
            return create_sync_group(
                store=store(),
                rank=tc.rank,
                world_size=tc.world_size,
                train_world_size=tc.world_size,
                backend="gloo",
                device=torch.device("cpu"),
                timeout_s=self._trainer_timeout(),
                session=f"{session}/trainers",
                with_data=False,
            )

        def join_engine() -> SyncGroup:
            # The engine's session holds the source alone on the trainer side.
            group = create_sync_group(
                store=store(),
                rank=0,
                world_size=self.world_size,
                train_world_size=1,
                backend=self.dist_backend,
                device=self.device,
                timeout_s=self.collective_timeout_s,
                session=session,
            )
            try:
                group.agree(STATUS_OK, "", plan.digest)
            except BaseException:
                group.destroy()
                raise
            return group

        trainers = await self._in_thread(join_trainers, self._formation_limit())
        group: SyncGroup | None = None
        failure: Exception | None = None
        try:
            if self.is_source:
                # Before any worker is asked to join: a drifted engine config is
                # refused with nothing formed, and the trainer ranks share the verdict.
                await self._check_model_configs()
                group = await self._join_engine(join_engine, plan, session)
        except Exception as exc:
            if trainers is None:
                raise
            failure = exc
        if trainers is not None:
            # Every trainer rank learns the source's verdict and compares plan digests.
            try:
                await agree_formation(trainers, failure, plan.digest)
            except BaseException:
                for g in (group, trainers):
                    if g is not None:
                        await anyio.to_thread.run_sync(g.destroy)
                raise
        self._group, self._trainers, self._plan = group, trainers, plan
        self._session, self._syncs = session, 0
        if trainers is not None and self._heartbeat is None:
            self._heartbeat = Heartbeat(self._store, tc.rank)
        self._buffers = RotatingBuffers(plan, self.device) if self.is_source else None

    async def _join_engine(
        self, join: Callable[[], SyncGroup], plan: BucketPlan, session: str
    ) -> SyncGroup:
        """The source and every engine worker form the engine's session together."""
        # Ask every worker first (leaving any old group is idempotent and
        # cheap): an engine that knows a worker is dead fails this RPC at
        # once, whereas the rendezvous below would wait the whole
        # collective timeout for a rank that never comes, in a thread that
        # cannot be interrupted.
        workers = await self._rpc("aiosync_collective_destroy", {}, self.rpc_timeout_s)
        if len(workers) != self.inference_world_size:
            # Else the rendezvous would wait its whole limit for ranks that never come.
            raise ValueError(
                f"inference_world_size={self.inference_world_size}, but the engine has "
                f"{len(workers)} worker(s): pass inference_world_size={len(workers)}"
            )
        kwargs = {
            "master_addr": self.train_cluster.master_addr,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "train_world_size": 1,
            "backend": self.dist_backend,
            "plan": plan.to_json(),
            "timeout_s": self.collective_timeout_s,
            "session": session,
        }
        if self.delta_baseline is not None:
            kwargs["delta"] = True

        return await self._join_with_workers(join, "aiosync_collective_init", kwargs, session)

    async def _join_with_workers(
        self, join: Callable[[], SyncGroup], method: str, kwargs: dict[str, Any], session: str
    ) -> SyncGroup:
        """Run this rank's ``join`` (in a thread) and the workers' ``method`` RPC together.

        Whichever side fails first cancels the formation for the other at once: a
        worker waiting in the rendezvous for a source whose local set-up failed (or
        our own thread waiting for a worker that failed) gives up within ~50 ms
        instead of sitting out the whole formation limit.
        """

        async def local() -> SyncGroup:
            try:
                return await self._in_thread(join, self._formation_limit())
            except BaseException as exc:
                self._cancel_formation(session, f"trainer rank 0 failed: {_reason(exc)}")
                raise

        async def remote() -> list[Any]:
            try:
                return await self._rpc(method, kwargs, self._formation_limit())
            except BaseException as exc:
                self._cancel_formation(session, f"the engine's workers failed: {_reason(exc)}")
                raise

        group, _ = await self._both(local, remote)
        return group

    def _cancel_formation(self, session: str, reason: str) -> None:
        """Cancel ``session``'s formation on every rank (rank 0, which hosts the store).

        Called on the event loop: one ``compare_set`` on the store this process
        serves, a loopback round trip, so it also runs when the caller was cancelled.
        """
        if self._store is not None:
            cancel_formation(self._store, session, reason)

    async def _teardown(self, *, notify_workers: bool) -> None:
        group, self._group = self._group, None
        trainers, self._trainers = self._trainers, None
        # After a failed sync our group is gone but a worker may still hold its own.
        if notify_workers and self.is_source and self._formed_once():
            # Unreachable workers destroy a broken group themselves.
            with contextlib.suppress(SyncError):
                await self._rpc(self._destroy_rpc, {}, self.rpc_timeout_s)
        # A thread abandoned by a timeout or cancellation may still be in a collective
        # of these groups (each ends within the group's timeout): it destroys them
        # itself when it returns; a short wait spares that in the common case.
        await anyio.to_thread.run_sync(self._idle.wait, self.timeouts.after_failure_s)
        for g in (group, trainers):
            if g is None:
                continue
            if self._idle.is_set():
                await anyio.to_thread.run_sync(g.destroy)
            else:
                g.broken = True
                self._abandoned.set()  # the running thread destroys it when it returns

    def _formed_once(self) -> bool:
        """Whether the workers may hold a group of this synchronizer's."""
        return self._plan is not None

    # -- one sync --------------------------------------------------------------

    async def send(
        self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None
    ) -> int | Transferred:
        # The base class checked the scales against the manifest before anything moved.
        kv = kv_scale_entries(kv_scales)
        if self._needs_forming():
            await self._form_group()
        group, trainers, plan = self._group, self._trainers, self._plan
        assert plan is not None
        nbytes = plan.total_bytes + 4 * len(kv)
        rounds = None
        if trainers is not None:
            # The trainer ranks vote over the store, not over a group a failed rank
            # must take part in (see _votes); every rank counts its syncs alike.
            self._syncs += 1
            rounds = SyncRounds(
                self._store,
                f"aiosync/{self._session}/trainers/sync/{self._syncs}",
                trainers.rank,
                trainers.world_size,
                time.monotonic() + self.sync_timeout_s,
            )
        votes = SyncVotes(rounds, self.policy.iter_weights())
        failure: BaseException | None = None
        moved: int | Transferred = nbytes
        try:
            if self.is_source:
                assert group is not None
                moved = await self._send(group, plan, version, kv, votes)
            else:
                # The other trainer ranks take part in the gathers only.
                own: BaseException | None = None
                try:
                    async with votes.watching():
                        await self._in_thread(
                            functools.partial(_consume, votes.weights, plan), self.sync_timeout_s
                        )
                except BaseException as exc:
                    own = exc
                await votes.read(own)
        except BaseException as exc:
            failure = exc
        if failure is not None:
            # Whatever failed, the next sync re-forms the groups: a worker may still
            # sit in a receive, or hold a half-staged copy. Aborting the engine's
            # group now also makes every peer's pending collective fail at once.
            self._drop_engine_group()
        try:
            # The same outcome on every trainer rank, naming the rank that failed.
            await votes.outcome(failure)
        except BaseException:
            self._drop_trainer_group()
            raise
        if self.delta_baseline is not None and trainers is not None:
            # Only the source knows whether it sent a delta, and how many bytes:
            # every rank's COMMITTED event must say the same.
            said = await self._gather_ranks(
                [moved.nbytes, moved.delta] if isinstance(moved, Transferred) else None
            )
            if said is not None:
                moved = Transferred(int(said[0][0]), bool(said[0][1]))
        return moved

    def _needs_forming(self) -> bool:
        """Whether this rank's groups must be (re-)formed; after a failure every rank
        dropped them, so the trainer ranks re-form together."""
        if self._plan is None:
            return True
        if self.is_source and (self._group is None or self._group.broken):
            return True
        return self.train_cluster.world_size > 1 and (
            self._trainers is None or self._trainers.broken
        )

    async def _send(
        self,
        group: SyncGroup,
        plan: BucketPlan,
        version: int,
        kv: list[tuple[str, float]],
        votes: SyncVotes,
    ) -> Transferred:
        """The source: broadcast every bucket (or, with ``delta``, the patches) to the
        workers; returns what was sent.

        The trainer ranks' read vote sits between the last bucket and the
        workers' vote, so the workers refuse weights another rank failed to read.
        A delta reads (gathers) every tensor before the first byte moves, to diff
        it: its read vote comes before the stream, so no patch moves that another
        rank failed to read.
        """
        buffers = self._buffers
        assert buffers is not None
        kwargs: dict[str, Any] = {
            "version": version,
            "kv_names": [n for n, _ in kv],
            "verify": self.verify,
        }
        weights: Iterable[tuple[str, torch.Tensor]] = votes.weights
        baseline: DeltaBaseline | None = self.delta.baseline if self.delta is not None else None
        read = False
        if baseline is not None:
            if await self._workers_hold_baseline():
                try:
                    async with votes.watching():
                        wire = await self._in_thread(
                            functools.partial(plan_patches, baseline, plan, votes.weights),
                            self.sync_timeout_s,
                        )
                    baseline.stage(version, wire.patches)
                    plan, weights, kwargs["delta"] = wire.plan, wire.tensors, wire.spec
                except BaseException as exc:
                    await votes.read(exc)  # raises: the source failed
                    raise
                await votes.read(None)  # raises when another rank failed its read
                read = True
                buffers = buffers.for_plan(plan)  # type: ignore[assignment]
            else:
                weights = baseline.stage_full(version, votes.weights)
        stream = functools.partial(
            stream_buckets,
            group,
            plan,
            buffers,
            weights,
            version=version,
            kv=kv,
            verify=self.verify,
            cancelled=self._abandoned.is_set,
        )

        # The workers' RPC's failure, when it failed (in place: it runs beside local()).
        remote_failure: list[Exception] = []
        remote_done = anyio.Event()

        async def remote() -> list[Any]:
            try:
                return await self._rpc("aiosync_collective_receive", kwargs, self.sync_timeout_s)
            except Exception as exc:
                # A fleet's RPC may fail first on a healthy engine, whose worker's
                # collective lost the dead peer: name the dead one if it shows. (One
                # engine's own error already names it, and says why.)
                cause = await self._death_behind(exc) if len(self._engines()) > 1 else exc
                remote_failure.append(cause)
                raise cause from None
            finally:
                remote_done.set()

        # Staged: what the engine's watch (watch() below) found dead while this rank sent.
        watched: list[Exception] = []

        async def watch() -> None:
            """Staged: no RPC of the workers is in flight while this rank sends, so
            nothing would see one die (gloo waits for it, or words it "Read error",
            naming no one). Ask the engine (its health check) every
            :data:`_ENGINE_WATCH_S`; on a dead worker abort the group, naming it."""
            while True:
                await anyio.sleep(_ENGINE_WATCH_S)
                dead = await self._dead_worker()
                if dead is not None:
                    watched.append(dead)
                    group.abort(f"{type(dead).__name__}: {dead}")
                    return

        async def explained(exc: BaseException) -> BaseException:
            """The cause in place of a collective's failure here: gloo words a dead
            peer as "Connection reset by peer", naming no worker, whereas the engine
            knows which worker died (its health check, else its RPC's error)."""
            if self.overlap == "staged" and group.collective_failed:
                # gloo may hear of a death (a closed socket) before the engine does (the
                # process's exit, seen on the event loop): give it a moment.
                with anyio.move_on_after(_DEATH_NOTICE_S):
                    while not watched:
                        dead = await self._dead_worker()
                        if dead is not None:
                            watched.append(dead)
                            break
                        await anyio.sleep(0.02)
                if not watched:
                    return exc
                watched[0].add_note(f"meanwhile on trainer rank 0: {exc!r}")
                return watched[0]
            if self.overlap != "inplace" or not group.collective_failed:
                return exc
            group.abort(f"trainer rank 0 failed: {type(exc).__name__}: {exc}")
            with anyio.move_on_after(self.timeouts.after_failure_s):
                await remote_done.wait()
            cause = await self._dead_worker() or (remote_failure[0] if remote_failure else None)
            if cause is None:
                return exc
            cause.add_note(f"meanwhile on trainer rank 0: {exc!r}")
            return cause

        async def local() -> SendResult:
            if read:  # a delta: the patches are in hand, every rank read its part
                try:
                    sent, failure = await self._in_thread(stream, self.sync_timeout_s)
                except BaseException as exc:
                    raise await explained(exc) from None
            else:
                try:
                    async with votes.watching():
                        sent, failure = await self._in_thread(stream, self.sync_timeout_s)
                except BaseException as exc:
                    exc = await explained(exc)
                    await votes.read(exc)  # raises: the source failed
                    raise exc from None
                try:
                    await votes.read(failure)
                except Exception as exc:
                    failure = exc
            vote = functools.partial(vote_send, group, failure, names=self._describe_worker)
            try:
                await self._in_thread(vote, self.sync_timeout_s)
            except BaseException as exc:
                raise await explained(exc) from None
            return sent

        if self.overlap == "inplace":
            await self._wake_weights()
            sent, results = await self._both(local, remote, group=group)
        else:
            await self._rpc("aiosync_collective_stage", kwargs, self.rpc_timeout_s)
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                try:
                    sent = await local()
                except Exception as exc:
                    failure = exc
                tg.cancel_scope.cancel()
            if failure is not None:
                raise failure
            await self._wake_weights()
            results = await self._rpc(
                "aiosync_collective_commit", {"version": version}, self.rpc_timeout_s
            )
        self._check_results(sent, results)
        self.last_worker_results = results
        return Transferred(sent.nbytes, delta="delta" in kwargs)

    async def _death_behind(self, exc: Exception) -> Exception:
        """The dead worker's error in place of ``exc`` (with ``exc`` as a note) if the
        engine reports one within :data:`_DEATH_NOTICE_S`; else ``exc``. A worker's
        death reaches its peers' sockets before its engine sees the process exit."""
        with anyio.move_on_after(_DEATH_NOTICE_S):
            while True:
                dead = await self._dead_worker()
                if dead is not None:
                    dead.add_note(f"meanwhile the engine's workers: {exc!r}")
                    return dead
                await anyio.sleep(0.02)
        return exc

    async def _dead_worker(self) -> Exception | None:
        """The engine's word on a worker that died (its
        :class:`~aiosync.capabilities.HealthReporting` check, bounded by
        ``timeouts.after_failure_s``; a fleet names the engine); None: all alive, or
        the engine cannot tell."""
        if not isinstance(self.generation, HealthReporting):
            return None
        try:
            with anyio.fail_after(self.timeouts.after_failure_s):
                await self.generation.check_health()
        except TimeoutError:
            return None
        except Exception as exc:
            return exc
        return None

    # -- delta -----------------------------------------------------------------

    async def _workers_hold_baseline(self) -> bool:
        """Whether every worker holds the baseline's version whole (else: a full sync)."""
        delta = self.delta
        if delta is None or delta.baseline.version != self.weight_version:
            return False
        if not all(delta.holds(engine, self.weight_version) for engine in self._engines()):
            return False  # an engine discarded its weights since the baseline committed
        baseline = delta.baseline
        held = await self._rpc("aiosync_collective_held_version", {}, self.rpc_timeout_s)
        return len(held) == self.inference_world_size and all(h == baseline.version for h in held)

    async def _wake_weights(self) -> None:
        """Wake the engine's weights before any byte is loaded into them.

        An engine asleep at level 1 (vLLM: weights offloaded to CPU, restored on
        wake) would otherwise restore the old weights over the new ones when it
        is woken after the sync. Only an :class:`~aiosync.capabilities.Engine`
        is woken, and only when it may have released its weights
        (:class:`~aiosync.capabilities.SleepReporting`; one that does not say is
        woken). The KV cache is left to ``prepare_for_generation()`` after the sync.
        """
        with anyio.fail_after(self.rpc_timeout_s):
            await self._wake_engines("weights")

    def _drop_engine_group(self) -> None:
        group, self._group = self._group, None
        self._drop(group)

    def _drop_trainer_group(self) -> None:
        trainers, self._trainers = self._trainers, None
        self._drop(trainers)

    def _drop(self, group: SyncGroup | None) -> None:
        if group is None:
            return
        group.broken = True
        if self._idle.is_set():
            group.destroy()
        # else: the abandoned thread destroys it when it returns.

    def _check_results(self, sent: SendResult, results: list[Any]) -> None:
        # Not the digests: each worker compared them before its vote (a mismatch
        # failed the sync there, before any worker counted its weights valid).
        if len(results) != self.inference_world_size:
            raise TransportError(
                f"{len(results)} workers answered, inference_world_size is "
                f"{self.inference_world_size}"
            )
        for i, res in enumerate(results):
            if not isinstance(res, dict) or res.get("nbytes") != sent.nbytes:
                raise TransportError(
                    f"inference rank {i} reports {res!r}, expected nbytes={sent.nbytes}"
                )

    def _describe_worker(self, rank: int) -> str:
        """How messages name engine worker ``rank`` (its global rank): the engine's
        own words where it has them (a fleet: ``"engine 1 of 2 (EmbeddedEngine):
        engine worker 3"``), else ``"engine worker <rank>"``."""
        if isinstance(self.generation, WorkerDescribing):
            return self.generation.describe_worker(rank)
        return f"engine worker {rank}"

    # -- plumbing --------------------------------------------------------------

    def _formation_limit(self) -> float:
        return 2 * self.collective_timeout_s + self.rpc_timeout_s

    def _trainer_timeout(self) -> float:
        """Limit of the trainer ranks' votes, seconds: the other ranks wait in them while
        the source forms the engine's group or finishes its whole sync."""
        return max(self._formation_limit(), self.sync_timeout_s)

    async def _rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        with anyio.fail_after(timeout_s + 1.0):
            try:
                # Every worker-side call names this synchronizer: the group is its own.
                owned = {**kwargs, "owner": self._owner}
                return await self.generation.collective_rpc(method, (), owned, timeout_s)
            except SyncError:
                raise
            except TimeoutError as exc:
                raise SyncTimeoutError(f"{method} RPC exceeded {timeout_s} s") from exc
            except Exception as exc:
                raise TransportError(f"{method} RPC failed: {exc!r}") from exc

    async def _in_thread(self, fn: Callable[[], _T], limit_s: float) -> _T:
        """Run blocking collectives in a worker thread, bounded by an anyio timeout too.

        torch's own timeout fires first; the anyio one guards against a call
        that ignores it. A thread abandoned that way (or by cancellation) tears
        down the group it used or formed when it finally returns.
        """
        # A thread abandoned by an earlier timeout must finish (its collectives
        # time out) before another one drives a group.
        if not self._idle.is_set():
            await anyio.to_thread.run_sync(self._idle.wait, self.collective_timeout_s)
            if not self._idle.is_set():
                raise TransportError(
                    f"trainer rank {self.train_cluster.rank}: a thread of an earlier, "
                    "abandoned sync step is still inside a collective after "
                    f"collective_timeout_s={self.collective_timeout_s:g} s; shut this "
                    "synchronizer down and create another"
                )
        self._idle.clear()
        self._abandoned.clear()
        groups = (self._group, self._trainers)
        # "queued" until a worker thread starts ``run``; a call cancelled while queued
        # never runs (anyio skips a cancelled job), so nothing else would set _idle.
        state = ["queued"]
        lock = threading.Lock()

        def run() -> _T:
            with lock:
                if state[0] == "dropped":
                    raise TransportError("sync step cancelled before it started")
                state[0] = "running"
            result: Any = None
            try:
                result = fn()
                return result
            finally:
                if self._abandoned.is_set():
                    for g in (*groups, result):
                        if isinstance(g, SyncGroup):
                            g.broken = True
                            g.destroy()
                self._idle.set()

        try:
            with anyio.fail_after(limit_s):
                return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except BaseException:
            with lock:
                if state[0] == "queued":
                    state[0] = "dropped"  # it never touched a group: nothing to abandon
                    self._idle.set()
            if not self._idle.is_set():
                self._abandoned.set()
            raise

    async def _both(
        self,
        local: Callable[[], Awaitable[_T]],
        remote: Callable[[], Awaitable[list[Any]]],
        *,
        group: SyncGroup | None = None,
    ) -> tuple[_T, list[Any]]:
        """Run this rank's side and the workers' RPC together; neither cancels the other
        (each is bounded by its own timeout), so every rank reaches its vote.

        With ``group`` (a sync), the first side to fail aborts it
        (:meth:`SyncGroup.abort`): when the workers' RPC failed (an engine worker
        died: the engine says which), this rank and the surviving workers stop
        waiting in its collectives at once instead of at the group's timeout.

        Raises:
            The more telling of the two errors (:func:`~aiosync._fanout.most_telling`;
            this rank's side first among equals), the other attached as a note.
        """
        results: dict[str, Any] = {}
        errors: dict[str, Exception] = {}

        async def run(key: str, fn: Callable[[], Awaitable[Any]]) -> None:
            try:
                results[key] = await fn()
            except Exception as exc:
                errors[key] = exc
                if group is not None:
                    who = "trainer rank 0" if key == "local" else "the engine's workers"
                    group.abort(f"{who} failed: {type(exc).__name__}: {exc}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "local", local)
            tg.start_soon(run, "remote", remote)
        if errors:
            both = [errors[key] for key in ("local", "remote") if key in errors]
            raise most_telling(ExceptionGroup("the source and the workers failed", both))
        return results["local"], results["remote"]


def _consume(weights: Iterable[tuple[str, torch.Tensor]], plan: BucketPlan) -> None:
    """A non-source trainer rank's part: read (gather) every tensor, checked against
    the plan, sending nothing."""
    for _ in group_by_bucket(weights, plan):
        pass


def _reason(failure: BaseException) -> str:
    """``failure`` as the reason a formation was cancelled (a cancellation says so)."""
    if not isinstance(failure, Exception):
        return "init_communicator() was cancelled"
    return f"{type(failure).__name__}: {failure}"
