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

import functools
import logging
import secrets
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, TypeVar, Unpack

import anyio
import anyio.to_thread
import torch

from aiosync._config import DEFAULT_BUCKET_BYTES, Timeouts
from aiosync._delta_refit import DeltaRefit
from aiosync.capabilities import EngineWorkers
from aiosync.cluster import TrainCluster
from aiosync.delta import DeltaBaseline
from aiosync.errors import SyncError
from aiosync.options import TransportCapabilities
from aiosync.sources import RefitSource
from aiosync.synchronizer import KVScales, SharedKeywords, Transferred, WeightSynchronizer

from .._options import check_positive, check_seconds
from .._verify import Verify, check_verify
from ..packing import BucketPlan, group_by_bucket, plan_patches
from ._group import SyncGroup
from ._loops import RotatingBuffers, SendResult, stream_buckets, vote_send
from ._session import GroupSession
from ._votes import GroupRanks, Heartbeat, SyncRounds, SyncVotes
from ._wire import kv_scale_entries
from ._workers import _DEATH_NOTICE_S, WorkerQueries

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


class CollectiveWeightSynchronizer(WorkerQueries, GroupSession):
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
        **shared: ``sync_timeout_s``, ``event_backlog``, ``in_flight``,
            ``initial_version``, ``on_failure``
            (:class:`~aiosync.synchronizer.SharedKeywords`): as
            :class:`~aiosync.WeightSynchronizer`.
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
        serve_previous=True,
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
        rpc_timeout_s: float | None = None,
        collective_timeout_s: float | None = None,
        backend: DistBackend | None = None,
        **shared: Unpack[SharedKeywords],
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
        timeouts = shared.get("timeouts")
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise TypeError(f"timeouts must be an aiosync.Timeouts, got {type(timeouts).__name__}")
        shared["timeouts"] = (timeouts or Timeouts()).with_keywords(rpc_timeout_s=rpc_timeout_s)
        super().__init__(policy, generation, **shared)
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
        check_positive("bucket_bytes", bucket_bytes)
        if overlap not in ("inplace", "staged"):
            raise ValueError(f"overlap must be 'inplace' or 'staged', got {overlap!r}")
        check_seconds("collective_timeout_s", collective_timeout_s)
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
    def backend(self) -> DistBackend:
        """Deprecated name of :attr:`dist_backend`."""
        return self.dist_backend

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan of the current group. Raises SyncError before init."""
        if self._plan is None:
            raise SyncError("await init_communicator() first")
        return self._plan

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


def _consume(weights: Iterable[tuple[str, torch.Tensor]], plan: BucketPlan) -> None:
    """A non-source trainer rank's part: read (gather) every tensor, checked against
    the plan, sending nothing."""
    for _ in group_by_bucket(weights, plan):
        pass
