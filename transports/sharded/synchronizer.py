"""Non-colocated, many senders: every trainer rank sends its own shards to the workers
that hold them, each byte once.

The broadcast (:class:`~aiosync.transports.collective.CollectiveWeightSynchronizer`)
gathers every tensor to trainer rank 0 and sends all of it to every worker, so a
tensor-parallel worker receives ``TP`` times what it keeps and rank 0's link bounds
the refit. Here every rank of the sync group (trainer ranks ``0..T-1``, inference
workers ``T..T+W-1``) computes the same :class:`~aiosync.transports.sharded.Plan`
at ``init_communicator()`` from what each side holds: the trainer ranks' layouts
from their DTensor shards (:func:`~aiosync.transports.sharded.dtensor_layouts`), the
workers' from the engine (``aiosync_sharded_layout``: the embedded engine's
Megatron slices). Each sync replays it over point-to-point sends
(:func:`~aiosync.transports.sharded.run_plan`): no rank gathers, every sender busy
at once, each worker receiving only its slices.

Timeline of one sync::

    trainer rank r     handshake | bucket k to each worker it feeds, two in flight | finish | vote
    inference ranks    handshake | bucket k from each trainer rank that feeds it   | finish | vote

The vote is one small all-gather over the group's gloo control group: every rank
(trainers and workers) raises the same error when any of them failed, and a worker
marks its weights valid only after it. Versions, the in-flight policy, timeouts,
ownership and the engine's label are the base class's, as for every transport.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Unpack

import anyio
import anyio.to_thread

from aiosync._delta_refit import DeltaRefit
from aiosync.capabilities import EngineWorkers, ManifestReporting
from aiosync.cluster import TrainCluster
from aiosync.errors import RefitMismatchError, SyncError, TransportError
from aiosync.layout import Layout
from aiosync.options import TransportCapabilities
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.sources import RefitSource
from aiosync.synchronizer import KVScales, SharedKeywords, Transferred, WeightSynchronizer

from ..collective._group import (
    STATUS_OK,
    SyncGroup,
    create_sync_group,
    open_store,
)
from ..collective._votes import GroupRanks, agree_formation
from ..collective.synchronizer import CollectiveWeightSynchronizer, DistBackend
from ..packing import compare_manifests, dtype_name
from ._delta import ShardBaseline
from ._mooncake import mooncake_available
from ._p2p import P2PResult, SourceFn
from ._plan import Plan, make_plan
from ._source_layout import (
    dtensor_layouts,
    local_tensor_fn,
    manifest_dtypes,
    shard_refusal,
    single_rank_layouts,
)
from .worker import (
    DataPlane,
    layouts_from_wire,
    layouts_to_wire,
    run_delta_and_vote,
    run_plan_and_vote,
)

__all__ = ["ShardedWeightSynchronizer"]

_log = logging.getLogger(__name__)


class ShardedWeightSynchronizer(CollectiveWeightSynchronizer):
    """Shard-aware refit of a separate inference cluster: many senders, each byte once.

    Every trainer rank constructs one and makes the same calls (SPMD); rank 0 also
    drives the engine's workers (``generation.collective_rpc``), whose workers mix
    in :class:`~aiosync.transports.sharded.worker.ShardedWorkerMixin` and whose
    models report their layout (the embedded engine's do, tensor-parallel or not).
    Each rank reads only its own shards (``DTensor.to_local()``): no gathers.

    Args:
        policy: a :class:`~aiosync.refit.DTensorRefitSource` (FSDP2/DTensor shards,
            or a plain module on every rank), or, with one trainer rank, any
            refit source (its full tensors are sent).
        generation: the engine (used on rank 0 only).
        train_cluster: the trainer ranks and the sync group's meeting point.
        inference_world_size: the engine's worker count ``W`` (checked at init).
        dist_backend: ``"gloo"`` (CPU) or ``"nccl"``; default NCCL on CUDA, else gloo.
        bucket_bytes: bucket size per (trainer rank, worker) pair, bytes.
        timeouts, rpc_timeout_s, collective_timeout_s, sync_timeout_s, event_backlog,
            in_flight, initial_version: as for
            :class:`~aiosync.transports.collective.CollectiveWeightSynchronizer`.
        data_plane: what moves the buckets: ``"torch"`` (point-to-point sends in the
            sync group) or ``"mooncake"`` (Mooncake transfer-engine writes over TCP
            into buffers each worker registered, the control messages staying on the
            gloo group; needs ``pip install mooncake-transfer-engine-non-cuda`` and
            the ``libibverbs1`` system package).
        delta: send, per transfer (one box of one tensor, from one trainer rank to
            one worker), only the elements whose bits changed since the last version
            committed on every worker: flat indices in the full tensor's coordinates
            plus values, or the box dense when that is smaller (:mod:`._delta`); the
            workers write them through their model's ``apply_weight_patches``. Each
            trainer rank keeps a host copy of the local tensors it sends (about its
            shard; two during a full sync, until it commits). The first sync, and any
            after a failed or cancelled one, discarded weights, a worker that does not
            hold the baseline (respawned, a new group) or a model that cannot apply
            patches, is a full one. ``data_plane="torch"`` only.

    Raises:
        RefitMismatchError: a trainer tensor whose shards are not whole HF tensors
            or parts of one (:func:`~aiosync.transports.sharded.shard_refusal`
            names it: a merged PEFT LoRA weight, a fused tensor cut along another
            dim than its experts'), before anything is built.
        ValueError, TypeError: as for the broadcast; an unknown ``data_plane``,
            ``"mooncake"`` with NCCL, or ``delta`` with ``"mooncake"``.
        TransportError: ``data_plane="mooncake"`` where Mooncake cannot run (the
            reason: not installed, ``libibverbs1`` missing).
    """

    #: What it can do, as data (:class:`~aiosync.TransportCapabilities`): the factory
    #: refuses a shared option outside it; the conformance kit runs its cells.
    capabilities = TransportCapabilities(
        delta=True,
        kv_scales=False,
        sharded_trainer=True,
        verify_engine=True,
    )

    kv_scales_refusal = (
        "the shard-aware transport does not move FP8 KV-cache scales; "
        "use CollectiveWeightSynchronizer for kv_scales"
    )
    _destroy_rpc = "aiosync_sharded_destroy"

    def __init__(
        self,
        policy: RefitSource,
        generation: EngineWorkers | Any,
        *,
        train_cluster: TrainCluster,
        inference_world_size: int,
        dist_backend: DistBackend | None = None,
        bucket_bytes: int | None = None,
        rpc_timeout_s: float | None = None,
        collective_timeout_s: float | None = None,
        data_plane: DataPlane = "torch",
        delta: bool = False,
        **shared: Unpack[SharedKeywords],
    ) -> None:
        # Before the base class registers anything on the engine: every rank refuses alike.
        refusal = shard_refusal(policy)
        if refusal is not None:
            raise RefitMismatchError(
                f"the shard-aware transport cannot send {refusal}: use the broadcast "
                "(sharded=False), which gathers it"
            )
        super().__init__(
            policy,
            generation,
            train_cluster=train_cluster,
            inference_world_size=inference_world_size,
            dist_backend=dist_backend,
            bucket_bytes=bucket_bytes,
            rpc_timeout_s=rpc_timeout_s,
            collective_timeout_s=collective_timeout_s,
            **shared,
        )
        if not isinstance(policy, DTensorRefitSource) and train_cluster.world_size > 1:
            raise TypeError(
                "with several trainer ranks the shard-aware transport reads each rank's "
                f"shards from a DTensorRefitSource, got {type(policy).__name__}"
            )
        if data_plane not in ("torch", "mooncake"):
            raise ValueError(f"data_plane must be 'torch' or 'mooncake', got {data_plane!r}")
        if delta and data_plane != "torch":
            raise ValueError(
                "delta=True sends its patches point to point: it needs data_plane='torch'"
            )
        if data_plane == "mooncake":
            if self.dist_backend != "gloo":
                raise ValueError(
                    "data_plane='mooncake' moves host memory over TCP: it needs "
                    "dist_backend='gloo' for the control messages"
                )
            reason = mooncake_available()
            if reason is not None:
                raise TransportError(f"data_plane='mooncake': {reason}")
        #: What moves the buckets (``"torch"``: the group's point-to-point sends).
        self.data_plane: DataPlane = data_plane
        self._transfer_plan: Plan | None = None
        # What this rank last sent every worker, for delta syncs (its own baseline:
        # each rank sends its shards).
        self.delta = DeltaRefit(ShardBaseline()) if delta else None

    @property
    def world_size(self) -> int:
        """Ranks of the sync group: every trainer rank and every inference worker."""
        return self.train_cluster.world_size + self.inference_world_size

    @property
    def transfer_plan(self) -> Plan:
        """The plan every rank replays each sync. Raises SyncError before init."""
        if self._transfer_plan is None:
            raise SyncError("await init_communicator() first")
        return self._transfer_plan

    # -- forming ---------------------------------------------------------------

    def _formed_once(self) -> bool:
        return self._transfer_plan is not None

    def _needs_forming(self) -> bool:
        if self._transfer_plan is None or self._group is None or self._group.broken:
            return True
        return self.train_cluster.world_size > 1 and (
            self._trainers is None or self._trainers.broken
        )

    async def _form_group(self) -> None:
        self._check_backend()
        await self._teardown(notify_workers=False)
        self._transfer_plan = None
        manifest = await self._read_manifest()
        tc = self.train_cluster
        self._sessions += 1
        session = f"sharded-{self._sessions}"
        await self._open_store()
        trainers: SyncGroup | None = None
        if tc.world_size > 1:
            trainers = await self._in_thread(
                lambda: self._join_trainers(self._store, session), self._formation_limit()
            )
        try:
            spec = await self._agree_on_layouts(manifest, trainers)
            plan = await anyio.to_thread.run_sync(
                lambda: make_plan(
                    layouts_from_wire(spec["sources"]),
                    layouts_from_wire(spec["destinations"]),
                    manifest_dtypes(manifest),
                    self.bucket_bytes,
                )
            )
            group = await self._join(session, spec, plan)
        except BaseException:
            if trainers is not None:
                await anyio.to_thread.run_sync(trainers.destroy)
            raise
        self._group, self._trainers, self._transfer_plan = group, trainers, plan
        self._session, self._syncs = session, 0
        _log.info(
            "sharded plan %s: %d trainer rank(s) -> %d worker(s), %d bytes per sync, per worker %s",
            plan.digest[:12],
            plan.num_senders,
            plan.num_receivers,
            plan.total_nbytes,
            list(plan.receiver_nbytes),
        )

    async def _open_store(self) -> None:
        tc = self.train_cluster
        if self._store is not None:
            return
        self._store = await anyio.to_thread.run_sync(
            lambda: open_store(
                tc.master_addr,
                tc.master_port,
                is_master=self.is_source,
                timeout_s=self.collective_timeout_s,
            )
        )
        if self.is_source:
            self._bound_port = int(self._store.port)

    def _source_layouts(self, manifest: Any) -> list[Layout]:
        if isinstance(self.policy, DTensorRefitSource):
            return dtensor_layouts(self.policy, self.train_cluster.world_size)
        return single_rank_layouts(manifest, 1)

    async def _agree_on_layouts(self, manifest: Any, trainers: SyncGroup | None) -> dict[str, Any]:
        """Rank 0 asks the engine what each worker holds; every trainer rank gets the
        same spec (or the same error) from it."""
        spec: dict[str, Any] | None = None
        failure: Exception | None = None
        if self.is_source:
            try:
                await self._check_model_configs()
                await self._check_manifest(manifest)
                sources = await anyio.to_thread.run_sync(self._source_layouts, manifest)
                replies = await self._rpc("aiosync_sharded_layout", {}, self.rpc_timeout_s)
                if len(replies) != self.inference_world_size:
                    raise ValueError(
                        f"inference_world_size={self.inference_world_size}, but the engine "
                        f"has {len(replies)} worker(s): pass inference_world_size={len(replies)}"
                    )
                held = {name for layout in replies for name in layout}
                unheld = [name for name in manifest if name not in held]
                if unheld:
                    # The plan moves only what some worker holds: a trainer tensor no
                    # worker holds would be dropped without a word.
                    raise RefitMismatchError(
                        f"{len(unheld)} name(s) of the trainer's manifest no engine worker "
                        f"holds, first: {unheld[:3]}"
                    )
                spec = {
                    "sources": layouts_to_wire(sources),
                    "destinations": list(replies),
                    "dtypes": {n: dtype_name(d) for n, d in manifest_dtypes(manifest).items()},
                    "bucket_bytes": self.bucket_bytes,
                }
            except Exception as exc:
                failure = exc
        if trainers is None:
            if failure is not None:
                raise failure
            assert spec is not None
            return spec
        await agree_formation(trainers, failure, "")
        ranks = GroupRanks(trainers)
        with anyio.CancelScope(shield=True):
            gathered = await ranks.all_gather(json.dumps(spec) if self.is_source else None)
        return dict(json.loads(gathered[0]))

    async def _check_manifest(self, manifest: Any) -> None:
        """The trainer's names, shapes and dtypes against the engine's loader, where the
        engine says what it loads (as the broadcast's workers compare them).

        Raises:
            RefitMismatchError: the first differences, both ways.
        """
        if not isinstance(self.generation, ManifestReporting):
            return
        expected = await self.generation.expected_manifest()
        if expected is not None:
            # Every box is routed by name: the checkpoint's order (safetensors sorts its
            # header) need not be the trainer's (transformers' MoE revert lists every
            # expert's down_proj, then every gate_proj, ...).
            compare_manifests(manifest, expected, order=False)

    async def _join(self, session: str, spec: dict[str, Any], plan: Plan) -> SyncGroup:
        """Every trainer rank and every worker form the session's group together."""
        tc = self.train_cluster

        def join() -> SyncGroup:
            return create_sync_group(
                store=self._store,
                rank=tc.rank,
                world_size=self.world_size,
                train_world_size=tc.world_size,
                backend=self.dist_backend,
                device=self.device,
                timeout_s=self.collective_timeout_s,
                session=session,
                every_rank_sends=True,
                verdict=(STATUS_OK, "", plan.digest),
            )

        if not self.is_source:
            return await self._in_thread(join, self._formation_limit())
        kwargs = {
            "master_addr": tc.master_addr,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "train_world_size": tc.world_size,
            "backend": self.dist_backend,
            "plan": spec,
            "timeout_s": self.collective_timeout_s,
            "session": session,
            "data_plane": self.data_plane,
        }
        if self.delta_baseline is not None:
            kwargs["delta"] = True

        return await self._join_with_workers(join, "aiosync_sharded_init", kwargs, session)

    # -- one sync --------------------------------------------------------------

    async def send(
        self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None
    ) -> int | Transferred:
        if self._needs_forming():
            await self._form_group()
        group, plan = self._group, self._transfer_plan
        assert group is not None and plan is not None
        baseline: ShardBaseline | None = self.delta.baseline if self.delta is not None else None
        source = await anyio.to_thread.run_sync(self._sender_source)
        # Set once this rank's share of the plan passed the group's vote: then every
        # rank's did (trainers and workers), and every trainer rank reaches the gather.
        sent: list[P2PResult] = []
        failure: BaseException | None = None
        base: int | None = None
        try:
            base = await self._delta_base()
            if baseline is not None and base is None:
                source = baseline.stage_source(version, source)

            def send() -> P2PResult:
                if base is None:
                    result = run_plan_and_vote(
                        plan,
                        group,
                        source=source,
                        device=self.device,
                        timeout_s=self.collective_timeout_s,
                        data_plane=self.data_plane,
                    )
                else:
                    assert baseline is not None
                    result = run_delta_and_vote(
                        plan,
                        group,
                        base=base,
                        version=version,
                        source=source,
                        baseline=baseline,
                        device=self.device,
                        timeout_s=self.collective_timeout_s,
                    )
                sent.append(result)
                return result

            if self.is_source:
                await self._wake_weights()
                kwargs: dict[str, Any] = {"version": version}
                if base is not None:
                    kwargs["delta"] = {"base": base}
                _sent, results = await self._both(
                    lambda: self._in_thread(send, self.sync_timeout_s),
                    lambda: self._rpc("aiosync_sharded_receive", kwargs, self.sync_timeout_s),
                )
                self._check_replies(plan, results, delta=base is not None)
                self.last_worker_results = results
            else:
                await self._in_thread(send, self.sync_timeout_s)
        except BaseException as exc:
            # The next sync re-forms the group: a peer may be gone or mid-receive.
            self._drop_engine_group()
            failure = exc
        if base is None:
            if failure is not None:
                raise failure
            return Transferred(plan.total_nbytes) if baseline is not None else plan.total_nbytes
        try:
            nbytes = await self._agree_on_delta(sent, failure)
        except BaseException:
            # Another rank failed after the vote (rank 0's check of the replies): every
            # rank re-forms the group for the next sync, as after any failure.
            self._drop_engine_group()
            raise
        return Transferred(nbytes, delta=True)

    def _check_replies(self, plan: Plan, results: list[Any], *, delta: bool) -> None:
        """Every worker's reply: the plan's bytes (a delta's are checked per pair by
        each pair's finish)."""
        if len(results) != self.inference_world_size:
            raise TransportError(
                f"{len(results)} workers answered, inference_world_size is "
                f"{self.inference_world_size}"
            )
        for i, (reply, want) in enumerate(zip(results, plan.receiver_nbytes, strict=True)):
            if not isinstance(reply, dict) or reply.get("delta", False) != delta:
                raise TransportError(
                    f"inference rank {i} reports {reply!r}, expected delta={delta}"
                )
            if not delta and reply.get("nbytes") != want:
                raise TransportError(
                    f"inference rank {i} reports {reply!r}, expected nbytes={want}"
                )

    # -- delta -----------------------------------------------------------------

    async def _delta_base(self) -> int | None:
        """The version every trainer rank's baseline and every worker hold (the base of
        a delta sync), or None: a full sync. The same on every trainer rank.

        Raises:
            TransportError: rank 0 could not ask the workers (every rank raises).
        """
        if self.delta is None:
            return None
        mine = self.delta.baseline.version
        if mine != self.weight_version or not all(
            self.delta.holds(engine, self.weight_version) for engine in self._engines()
        ):
            mine = None  # no baseline, or an engine discarded its weights since
        problem: str | None = None
        if self.is_source and mine is not None:
            try:
                held = await self._rpc("aiosync_sharded_held_version", {}, self.rpc_timeout_s)
            except Exception as exc:
                if self._trainers is None:
                    raise
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if len(held) != self.inference_world_size or any(h != mine for h in held):
                    mine = None
        if self._trainers is None:
            return mine
        # Rank 0 alone knows the workers: every rank takes a delta or none.
        said = await self._gather_ranks([mine, problem])
        if said is None:
            return None
        if said[0][1] is not None:
            raise TransportError(f"trainer rank 0 could not ask the workers: {said[0][1]}")
        versions = {v for v, _ in said}
        return versions.pop() if len(versions) == 1 else None

    async def _agree_on_delta(self, sent: list[P2PResult], failure: BaseException | None) -> int:
        """A delta's payload bytes of every trainer rank together (the same COMMITTED
        event on every rank), or the failure: one rank's failure after the group's vote
        (rank 0's check of the workers' replies) fails every rank.

        Raises:
            ``failure``, or TransportError naming the rank that failed.
        """
        mine = sent[0].nbytes if sent else 0
        if self._trainers is None or not sent or not isinstance(failure, Exception | None):
            # One trainer rank; or this rank's plan failed the vote, and so did every
            # rank's (or it was cancelled): nothing to agree on.
            if failure is not None:
                raise failure
            return mine
        reason = None if failure is None else f"{type(failure).__name__}: {failure}"
        said = await self._gather_ranks([mine, reason])
        if failure is not None:
            raise failure
        if said is None:
            return mine
        for rank, (_, problem) in enumerate(said):
            if problem is not None:
                raise TransportError(f"trainer rank {rank} failed after the transfer: {problem}")
        return sum(int(n) for n, _ in said)

    def _sender_source(self) -> SourceFn:
        """This rank's ``hf_name -> local tensor`` for the sync about to run."""
        if isinstance(self.policy, DTensorRefitSource):
            return local_tensor_fn(self.policy)
        weights = dict(self.policy.iter_weights())
        return weights.__getitem__
