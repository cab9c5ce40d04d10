"""Colocated refit: the trainer packs buckets into shared buffers and sends handles over ZMQ.

Trainer and engine share the device(s), so the weights never cross a network:
:class:`IPCWeightSynchronizer` packs each bucket of the
:class:`~aiosync.transports.packing.BucketPlan` into one of two shared buffers (POSIX
shared memory on CPU, CUDA IPC memory on GPU; see ``transports/_shm.py``) and
sends the engine's workers only the buffer's handle. The workers
(:class:`~aiosync.transports.ipc.worker.IPCWorkerMixin`) map the buffer, unpack views
and call ``load_weights``.

Protocol, per sync (msgpack maps over a ZMQ ROUTER bound to ``ipc://`` in a
private 0700 directory, ``aiosync-ipc-<pid>-*`` in the temp dir; the first
``init_communicator()`` removes those and the segments of dead aiosync
processes, see :mod:`aiosync.transports._leftovers`; the trainer drives the
workers' receive loop with ``collective_rpc("aiosync_ipc_receive", ...)``
concurrently):

1. worker → ``hello {sync_id, rank, digest}``: the trainer checks every digest
   against its plan before any data moves (:class:`RefitMismatchError`).
2. trainer → ``data {sync_id, seq, bucket, handle}`` per bucket (with ``verify``
   on, also ``verify``, ``key`` and ``digest``: the digest of the packed bucket,
   :mod:`aiosync.transports._verify`); worker → ``ack {sync_id, seq}`` once its
   copies finished and the digest of what it received matched
   (:class:`~aiosync.errors.RefitVerificationError` otherwise). Ping-pong: bucket ``k+1`` is
   packed while the engine loads bucket ``k``; a buffer is reused only after
   every worker acknowledged the bucket it held. A bucket larger than the
   buffers (a lone oversized tensor) gets a buffer of its own, freed after its acks.
   In direct mode (``direct=True``, the default) a bucket whose every tensor lies in
   a shared-memory arena of the trainer (:func:`aiosync.refit.share_parameters`)
   travels as ``data {sync_id, seq, bucket, direct: [[arena, nbytes, offset], ...]}``
   (CUDA: ``[[arena fields, offset], ...]``, the arena's CUDA-IPC handle, the same
   every sync) instead: no packing, the worker copies from the trainer's own memory
   (``transports/ipc/_direct.py``). It asks no ack (``ack: false``): no buffer
   waits for it, so a run of direct buckets is read in one thread hop and sent at
   once, and the trainer stays idle while the workers copy.
3. trainer → ``end {sync_id, buckets, kv_scales}`` once every worker acknowledged
   every bucket (``end`` commits: no worker may take it while another can still
   fail); each worker checks every manifest entry arrived exactly once, loads
   the FP8 KV-cache scales (engine names, float32), sets its weights valid,
   answers ``done``.

Inline (CPU, one worker, one trainer rank, no delta, a plan whose every bucket has
a buffer of its own and of at most 16 MiB in all): the trainer packs every bucket
first and sends its ``data`` messages and ``end`` inside the receive's session
(``inline``); the worker loads them as if received, with no connection, hello or
ack, and its reply is the ``done``: one round trip (``benchmarks/fixed_cost.py``).

With ``delta=True`` (:mod:`aiosync.delta`) the trainer first asks every worker
which version it holds whole (``aiosync_ipc_held_version``). The workers that
hold the baseline's version get only the patches (their wire tensors, in a
per-sync wire plan over the same buffers, a bucket too large for them in one of
its own); any other worker (a respawned one, one that discarded its weights, a
new engine of a fleet) gets every tensor of the plan in the same sync, before or
after them over the same socket (one ``hello`` and one ``end`` for all).

A sharded trainer (``process_group``) runs this on every rank: each rank binds
its own socket and streams to the workers on its device only; the session sent
to the workers maps each device to its rank's socket (``endpoints``), and the
ranks agree on the outcome over the group before anyone commits.

Any failure: the trainer sends ``abort`` (best effort), the base class keeps
``weight_version`` and marks the engine stale; the workers keep their weights
marked invalid, so the engine refuses to generate until a sync succeeds.

The stream runs inside the base class's colocated bracket (offload the trainer,
wake the engine's weights, stream, offload back, wake its KV cache; see
``docs/lifecycle.md``).

Tracing (off by default; ``trace=True`` or ``sync.trace = True``): every sync
records per-bucket ``time.monotonic()`` timestamps, seconds, on both sides into
:attr:`IPCWeightSynchronizer.last_trace` (see there). The workers' come back in
their receive replies. Trainer and workers share one clock when they share a
host: on Linux ``time.monotonic()`` is ``CLOCK_MONOTONIC``, one system-wide
clock, so the timestamps of different processes compare directly.

Requires an asyncio event loop (pyzmq's asyncio sockets).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
from collections.abc import Iterator, Sequence
from typing import Any, Unpack

import anyio
import anyio.lowlevel
import torch

from aiosync._config import Timeouts
from aiosync._delta_refit import DeltaRefit
from aiosync._fanout import most_telling, named
from aiosync._kv_scales import attention_layers, kv_scale_entries
from aiosync.capabilities import WorkerDescribing, engines_of
from aiosync.delta import DeltaBaseline
from aiosync.errors import RefitMismatchError, SyncError, TransportError
from aiosync.options import TransportCapabilities
from aiosync.sources import GathersInto, RefitManifest, RefitSource
from aiosync.synchronizer import KVScales, SharedKeywords, Transferred, WeightSynchronizer

from .._identity import CPU_LABEL, device_identity
from .._options import check_fraction, check_positive, check_seconds
from .._ranks import TrainerRanks
from .._verify import Verify, check_verify
from .._wire import error_fields, rebuild_error
from ..packing import BucketPlan, plan_buckets, plan_patches
from ._router import _check_reply
from ._sender import _SHUT_DOWN_MID_SYNC, _Ahead, _BucketSender, _Lane
from ._votes import RankVotes, collective_error, own_process

__all__ = [
    "DEFAULT_BUFFER_MEMORY_FRACTION",
    "DEFAULT_PIPELINE_BUCKETS",
    "IPCWeightSynchronizer",
    "default_bucket_bytes",
]

#: Share of the device's free memory one staging buffer takes when no
#: ``bucket_bytes`` is given (two buffers are used). For comparison, NeMo-RL's IPC
#: refit takes 30 % of free memory split over its two buffers
#: (``NRL_REFIT_BUFFER_MEMORY_RATIO``, ``nemo_rl/weight_sync/ipc_weight_synchronizer.py``),
#: its collective packing 2 % of *total* memory per buffer, at most 5 GiB
#: (``nemo_rl/utils/packed_tensor.py``). aiosync keeps the small share until an idle
#: benchmark shows a larger one pays for the memory it takes from the KV cache.
DEFAULT_BUFFER_MEMORY_FRACTION: float = 0.02
#: Largest default staging buffer, bytes (NeMo-RL caps at 5 GiB).
_MAX_DEFAULT_BUCKET_BYTES = 5 * 1024**3
#: Smallest default staging buffer, bytes.
_MIN_DEFAULT_BUCKET_BYTES = 16 * 1024**2
#: By default a refit is cut into at least this many buckets: packing bucket k+1
#: overlaps the engine loading bucket k, and with one bucket the two copies run
#: one after the other (``benchmarks/ipc.py --trace``).
DEFAULT_PIPELINE_BUCKETS = 8
#: ... but no default bucket is smaller than this, bytes: each bucket costs a
#: message round trip and a thread hop.
_MIN_PIPELINED_BUCKET_BYTES = 4 * 1024**2
#: Limit of the workers' ``aiosync_ipc_release`` at shutdown, seconds (best effort).
_RELEASE_TIMEOUT_S = 2.0
_log = logging.getLogger(__name__)

#: The largest refit sent inside the receive's session when every bucket of it goes
#: direct (only refs travel), bytes: one copy of it ends well within that 1 s too.
_INLINE_DIRECT_MAX_BYTES = 256 * 1024 * 1024


def default_bucket_bytes(
    device: torch.device,
    fraction: float = DEFAULT_BUFFER_MEMORY_FRACTION,
    manifest: RefitManifest | None = None,
) -> int:
    """Staging-buffer size, bytes: ``fraction`` of ``device``'s free memory, in [16 MiB, 5 GiB].

    Free memory is ``torch.cuda.mem_get_info`` on CUDA and the available
    physical memory (``sysconf``) on CPU. Given the refit's ``manifest``
    (``{hf_name: (shape, dtype)}``), the size is cut to what splits it into
    :data:`DEFAULT_PIPELINE_BUCKETS` buckets (so that packing and loading
    overlap), but not below 4 MiB nor below its largest tensor.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    size = int(min(_MAX_DEFAULT_BUCKET_BYTES, max(_MIN_DEFAULT_BUCKET_BYTES, free * fraction)))
    if manifest:
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in manifest.values()]
        pipelined = -(-sum(sizes) // DEFAULT_PIPELINE_BUCKETS)
        size = min(size, max(pipelined, _MIN_PIPELINED_BUCKET_BYTES, max(sizes)))
    return size


class IPCWeightSynchronizer(WeightSynchronizer):
    """Colocated refits into an engine's workers through shared buffers (see module docs).

    Moves FP8 KV-cache scales: ``sync_weights(kv_scales=...)`` sends them with
    the ``end`` message; each worker loads them after the last bucket, as 0-d
    float32 tensors, before its weights count as valid. Their layers are checked
    against the manifest read at init, before any event.

    Args:
        policy: the trainer's :class:`~aiosync.RefitSource` (HF checkpoint names).
        generation: the engine: a :class:`~aiosync.GenerationBackend` that is also
            an :class:`~aiosync.EngineWorkers` (``collective_rpc``) whose workers
            include :class:`~aiosync.transports.ipc.worker.IPCWorkerMixin`.
        bucket_bytes: staging-buffer size, bytes; default: ``buffer_memory_fraction``
            of the device's free memory, cut so that the refit spans at least
            :data:`DEFAULT_PIPELINE_BUCKETS` buckets (:func:`default_bucket_bytes`).
        buffer_memory_fraction: see ``bucket_bytes``.
        device: where the staging buffers live; default ``cuda`` (current device)
            when available, else ``cpu``.
        rpc_timeout_s: overrides ``timeouts.rpc_s``: the limit for every single
            wait (a hello, an ack, an RPC, the colocated wakes), seconds.
        **shared: ``sync_timeout_s``, ``event_backlog``, ``in_flight``,
            ``initial_version``, ``on_failure``
            (:class:`~aiosync.synchronizer.SharedKeywords`): as
            :class:`~aiosync.WeightSynchronizer`.
        timeouts: every limit (:class:`~aiosync.Timeouts`); default ``Timeouts()``.
        process_group: a sharded trainer's ``torch.distributed`` group. Every rank
            runs a synchronizer and makes the same calls (the source's gathers are
            collectives); rank ``r`` packs on its own device and sends only to the
            engine workers on that device, all devices at once. Group rank 0
            holds the engine (``generation``; pass None on the other ranks) and
            drives its RPCs. A sync commits on every rank or fails on every rank
            with the same typed error (the ranks agree over this group: use gloo,
            whose timeout bounds the agreement). None: a single-process trainer
            feeding every worker.
        device_label: this rank's device identity for the pairing, matched
            against each worker's (the embedded engine's ``device_labels`` on
            CPU); default: the GPU UUID on CUDA, ``"cpu"`` on CPU.
        trace: record per-bucket timestamps of every sync into
            :attr:`last_trace` (see the module docs); off by default.
        delta: send, per tensor, only the elements whose bits changed since the
            last version committed on every worker, in the smallest encoding for
            that tensor and sync (:mod:`aiosync.delta`); the workers write the
            patches in place (``apply_weight_patches``). Costs one host copy of
            the weights (the baseline; two during a full sync). The first sync,
            and any after a failed or cancelled one, is full; so is, for that
            worker alone, the sync of a worker that does not hold the baseline
            (respawned, discarded weights, a model without
            ``apply_weight_patches``), the others getting the patches in the same
            sync (the source is then read twice). With several trainer ranks each
            rank keeps its own baseline (a host copy of the full tensors it
            gathers) and sends its workers the patches, and a sync is a delta
            only when every worker holds the base (else full everywhere: one
            choice, rank 0's, so that the ranks' gathers stay paired).
        verify: check every bucket on arrival (:mod:`aiosync.transports._verify`):
            ``True`` (the default) digests every byte (the block-sum digest: any
            single flipped bit is caught), while packing, each chunk in cache, and
            each worker each tensor as ``load_weights`` took it; ``"sample"`` the
            first and last byte of every tensor and 4096 bytes in runs of 8 drawn
            afresh per sync and bucket (a cost that does not grow with the bucket);
            ``False`` nothing. Each worker digests the bytes of the shared
            buffer after its copy out of them (a delta's patches alike); a
            mismatch fails the sync with
            :class:`~aiosync.errors.RefitVerificationError` naming the bucket
            and its first tensor, the worker's weights stay invalid until a sync
            lands. Read at each sync (``sync.verify = True`` takes effect at the next).
            A direct bucket digests the tensors' own bytes, the same on both sides.
        direct: one copy instead of two where the trainer's tensors live in a shared
            arena (:func:`aiosync.refit.share_parameters`: named shared memory on CPU,
            a CUDA-IPC-shareable allocation on the synchronizer's GPU): a bucket
            whose every tensor is such a view (contiguous, in the manifest's dtype)
            is not packed; the workers map the trainer's memory (kept mapped between
            syncs) and copy from it into their weights. Any other bucket is packed
            (``transports/ipc/_direct.py``). Relies on the sync reading the tensors
            while no optimizer step runs: step inside :meth:`policy_update`. Default
            True (nothing changes for a trainer whose tensors are not shared).

    Raises:
        ValueError: a non-positive size, fraction or timeout; group rank 0 of a
            sharded trainer without ``generation``; ``verify`` is not ``True``,
            ``False`` or ``"sample"``.
        TypeError: ``timeouts`` is not an :class:`~aiosync.Timeouts`.
    """

    #: What it can do, as data (:class:`~aiosync.TransportCapabilities`): the factory
    #: refuses a shared option outside it; the conformance kit runs its cells.
    capabilities = TransportCapabilities(
        verify=frozenset({False, "sample", True}),
        delta=True,
        trace=True,
        elastic=True,
        sharded_trainer=True,
        verify_engine=True,
        serve_previous=True,
    )

    def __init__(
        self,
        policy: RefitSource,
        generation: Any,
        *,
        bucket_bytes: int | None = None,
        buffer_memory_fraction: float = DEFAULT_BUFFER_MEMORY_FRACTION,
        device: torch.device | str | None = None,
        rpc_timeout_s: float | None = None,
        process_group: Any = None,
        device_label: str | None = None,
        trace: bool = False,
        delta: bool = False,
        verify: Verify = True,
        direct: bool = True,
        **shared: Unpack[SharedKeywords],
    ) -> None:
        # Every check before the base class's __init__, which registers the
        # discard listener on the engine: a refused synchronizer leaves none behind.
        verify = check_verify(verify)
        ranks = TrainerRanks.driving(process_group, generation)
        check_positive("bucket_bytes", bucket_bytes)
        check_fraction("buffer_memory_fraction", buffer_memory_fraction)
        check_seconds("rpc_timeout_s", rpc_timeout_s)
        timeouts = shared.get("timeouts")
        if isinstance(timeouts, Timeouts):
            shared["timeouts"] = timeouts.with_keywords(rpc_timeout_s=rpc_timeout_s)
        elif timeouts is None and rpc_timeout_s is not None:
            shared["timeouts"] = Timeouts(rpc_s=rpc_timeout_s)
        super().__init__(policy, generation, ranks=ranks, **shared)
        self._ranks = ranks
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.bucket_bytes = bucket_bytes
        self.buffer_memory_fraction = buffer_memory_fraction
        self.device_id = device_identity(self.device, device_label)
        self.plan: BucketPlan | None = None
        self.num_workers = 0
        #: Global ranks of the engine workers this trainer rank sends to.
        self.peers: list[int] = []
        # Global ranks of every engine worker (all trainer ranks'), from init.
        self._all_workers: list[int] = []
        self._endpoints: dict[str, str] | None = None
        # Every rank's (hostname, pid), gathered at init: names a dead rank.
        self._rank_processes: list[tuple[str, int]] = []
        # Whether the driver started the workers' receive of the current sync.
        self._receiving = False
        self._session_token = ""
        self._syncs = 0
        self._sender: _BucketSender | None = None
        #: Whether each sync records :attr:`last_trace` (off by default).
        self.trace = trace
        #: How each bucket is checked on arrival (``True``, ``False``, ``"sample"``).
        self.verify: Verify = verify
        #: Whether buckets of shared-memory tensors go unpacked (read at each sync).
        self.direct = direct
        #: The timeline of the last sync made with :attr:`trace` on (None before
        #: one): ``{"clock": "time.monotonic", "trainer": [row per bucket],
        #: "workers": {global rank: [row per bucket]}}``, rows in send order,
        #: timestamps in seconds of ``time.monotonic()``. A trainer row is
        #: ``{"seq", "bucket", "bytes", "copied", "pack_start", "pack_end", "sent",
        #: "acked"}`` (``copied``: the tensor bytes packing copied, 0 for a direct
        #: bucket or one the source gathered into; ``sent``: the data message handed
        #: to the socket; ``acked``: the last
        #: worker's ack received; packing spans the source's read too); a worker
        #: row ``{"seq", "received", "load_start", "load_end", "ack_sent"}``
        #: (``ack_sent``: the ack handed to the socket). Workers of the driving
        #: rank only (the receive replies).
        self.last_trace: dict[str, Any] | None = None
        #: The workers' replies to the last successful sync's receive, in rank
        #: order: ``{"rank", "tensors", "bytes", "delta", ...}`` (``bytes``: the
        #: payload it loaded; ``delta``: it applied patches). Driver only.
        self.last_worker_results: list[dict[str, Any]] = []
        self.delta = DeltaRefit(DeltaBaseline()) if delta else None

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        """The fleet's engines changed: a fresh socket and buffers (the workers
        renumbered, no state of the failed round carries over), then re-init."""
        if self._sender is not None:
            sender, self._sender = self._sender, None
            self.plan = None
            await sender.aclose()
        await self.open(sync)

    @property
    def rpc_timeout_s(self) -> float:
        """The limit for every single wait, seconds (``timeouts.rpc_s``)."""
        return self.timeouts.rpc_s

    async def open(self, sync: WeightSynchronizer) -> None:
        """Build the bucket plan, open the socket and buffers, register the plan on every worker.

        May be called again (e.g. after the engine's workers were replaced).

        Raises:
            RefitMismatchError: a worker's model disagrees with the trainer's
                manifest (the first differing names on both sides).
            TransportError, SyncTimeoutError: a worker is unreachable.
        """
        self._check_open()
        manifest = await self._read_manifest()
        size = self.bucket_bytes or default_bucket_bytes(
            self.device, self.buffer_memory_fraction, manifest
        )
        if not self._ranks.sharded:
            workers = await self._init_plan_and_workers(manifest, size)
            # After the workers' manifest check, whose message names the engine's type.
            await self._check_model_configs()
            self.num_workers = len(workers)
            self.peers = [rank for rank, _device in workers]
            self._all_workers = sorted(self.peers)
            # One token for the synchronizer's life: a sync after a re-init then
            # supersedes a receive a failed sync left running on a worker, where a
            # new token would be refused as another synchronizer's (OwnershipError).
            self._session_token = self._session_token or secrets.token_hex(6)
        else:
            await self._init_sharded(manifest, size)

    async def _init_plan_and_workers(
        self, manifest: RefitManifest, bucket_bytes: int
    ) -> list[tuple[int, str]]:
        """Plan, socket and buffers (once); the engine's workers learn the plan.
        Returns each worker's ``(global rank, device identity)`` (driver only)."""
        if self.plan is None:
            plan = plan_buckets(manifest, bucket_bytes)
            self._sender = await _BucketSender.open(
                plan, self.device, self.rpc_timeout_s, self.device_id
            )
            self.plan = plan
            if isinstance(self.generation, WorkerDescribing):
                self._sender.describe_worker = self.generation.describe_worker
        elif plan_buckets(manifest, self.plan.bucket_bytes).digest != self.plan.digest:
            raise RefitMismatchError("the policy's manifest changed since init_communicator()")
        if not self._ranks.is_driver:
            return []
        replies = await self.generation.collective_rpc(
            "aiosync_ipc_init",
            (self.plan.to_json(), self.delta_baseline is not None),
            timeout_s=self.rpc_timeout_s,
        )
        for rank, reply in enumerate(replies):
            _check_reply(reply, rank, "aiosync_ipc_init")
        return [
            (int(reply.get("rank", i)), str(reply.get("device", CPU_LABEL)))
            for i, reply in enumerate(replies)
        ]

    async def _init_sharded(self, manifest: RefitManifest, bucket_bytes: int) -> None:
        # Every rank reaches the same verdict from the same gathered data, so an
        # error here is raised on all of them alike.
        proposed = await self._ranks.all_gather((self.device_id, bucket_bytes, own_process()))
        devices = [device for device, _size, _process in proposed]
        self._rank_processes = [process for _device, _size, process in proposed]
        if len(set(devices)) != len(devices):
            raise TransportError(f"two trainer ranks on one device: {devices}")
        error: dict[str, str] | None = None
        workers: list[tuple[int, str]] = []
        try:
            # One plan on every rank (the smallest buffer proposed): workers know one digest.
            workers = await self._init_plan_and_workers(manifest, min(s for _d, s, _p in proposed))
            await self._check_model_configs()  # the driver's engines; shared like the rest
        except Exception as exc:
            error = error_fields(exc)
        token = self._session_token or secrets.token_hex(6)
        endpoint = None if self._sender is None else self._sender.endpoint
        gathered = await self._ranks.all_gather((endpoint, error, workers, token))
        for rank, (_endpoint, err, _workers, _token) in enumerate(gathered):
            if err is not None:
                raise rebuild_error(err, f"trainer rank {rank}")
        _endpoint, _err, workers, self._session_token = gathered[0]
        self._endpoints = {devices[r]: str(g[0]) for r, g in enumerate(gathered)}
        orphans = sorted({device for _rank, device in workers} - set(devices))
        if orphans:
            raise TransportError(
                f"engine workers on devices {orphans}, where no trainer rank runs "
                f"(trainer ranks' devices: {devices}); pair every engine device with a rank"
            )
        self.num_workers = len(workers)
        self.peers = [rank for rank, device in workers if device == self.device_id]
        self._all_workers = sorted(rank for rank, _device in workers)

    async def send(
        self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None
    ) -> Transferred:
        assert self.plan is not None
        # The manifest's attention layers only when there are scales to check (a pass
        # over every name: no per-sync work for the syncs that move none).
        kv = (
            kv_scale_entries(kv_scales, attention_layers(self.plan.manifest())) if kv_scales else []
        )
        self._syncs += 1
        sync_id = f"{version}-{self._session_token}-{self._syncs}"
        # A sharded trainer's source gathers each tensor into the bucket's slot it is
        # packed to, when it can: the gather is the trainer's only copy of it.
        source, sender = self.policy, self._sender
        weights: Iterator[tuple[str, torch.Tensor]]
        gathers = False
        if (
            self._ranks.sharded
            and self.delta_baseline is None
            and sender is not None
            and isinstance(source, GathersInto)
        ):
            weights, gathers = source.iter_weights_into(sender.destination), True
        else:
            weights = source.iter_weights()
        votes: RankVotes | None = None
        if self._ranks.sharded:
            # One vote per tensor: a rank whose source fails leaves the gathers
            # together with the others (see _votes.py) instead of mismatching them.
            votes = RankVotes(weights, self._ranks.group, self._ranks.rank, self._rank_processes)
            weights = votes
        self._receiving = False
        failed: BaseException | None = None
        nbytes = 0
        spec: dict[str, Any] | None = None
        try:
            # Set since init: refused before anything moves (inside the try, so that a
            # sharded trainer's ranks agree on the failure instead of one leaving).
            verify = check_verify(self.verify)
            async with self._colocated_refit():
                lanes, spec = await self._lanes(version, weights, gathers=gathers)
                nbytes = await self._stream(sync_id, version, lanes, kv, spec, verify=verify)
        except BaseException as exc:
            failed = exc
        try:
            if not self._ranks.sharded:
                if failed is not None:
                    raise failed
            else:
                try:
                    await self._ranks.agree(weights, failed)
                except (SyncError, anyio.get_cancelled_exc_class()):
                    raise
                except Exception as exc:
                    if exc is failed:  # this rank's own error, agreed on
                        raise
                    # gloo's own error (RuntimeError, DistNetworkError): a rank is gone.
                    raise collective_error(
                        exc, self._rank_processes, self._ranks.rank, "the trainer ranks' agreement"
                    ) from exc
        except BaseException as exc:
            if self._receiving:
                await self._invalidate_workers(sync_id)
            if votes is not None and votes.verdict is not None and exc is not votes.verdict:
                # Every rank raises the vote's verdict, the same error on every rank.
                raise votes.verdict from None
            raise
        return Transferred(nbytes, delta=spec is not None)

    # -- delta -----------------------------------------------------------------

    async def _lanes(
        self, version: int, weights: Iterator[tuple[str, torch.Tensor]], *, gathers: bool = False
    ) -> tuple[list[_Lane], dict[str, Any] | None]:
        """What this sync sends to whom: every tensor to every worker, or (delta)
        the patches to the workers that hold the baseline and every tensor to the
        others; and the workers' ``delta`` session entry (None: no patches).
        ``gathers``: ``weights`` gathers into the sender's destination (no delta)."""
        assert self.plan is not None
        if self.delta is None:
            return [_Lane(self.plan, self.peers, weights, gathers)], None
        baseline: DeltaBaseline = self.delta.baseline
        holders = await self._workers_holding_baseline() if self._ranks.is_driver else []
        if self._ranks.sharded:
            # One choice on every rank, from the driver's RPCs: patches only when every
            # worker holds the base. A rank that re-read the source for its workers
            # alone would leave the gathers the ranks make together.
            everyone = holders == self._all_workers
            everyone = bool((await self._ranks.all_gather(everyone))[0])
            holders = self._all_workers if everyone else []
        if not holders:
            return [_Lane(self.plan, self.peers, baseline.stage_full(version, weights))], None
        wire = await anyio.to_thread.run_sync(plan_patches, baseline, self.plan, weights)
        wire_plan, wires, patches, spec = wire.plan, wire.tensors, wire.patches, wire.spec
        spec["ranks"] = holders
        lanes = [_Lane(wire_plan, [r for r in holders if r in self.peers], iter(wires))]
        others = [rank for rank in self.peers if rank not in holders]
        if others:
            # The workers without the base get every tensor: the source is read again
            # (under the source lock: the same version), and the baseline becomes
            # that full copy when the sync commits.
            full = baseline.stage_full(version, self.policy.iter_weights())
            lanes.append(_Lane(self.plan, others, full))
        else:
            baseline.stage(version, patches)
        return lanes, spec

    async def _workers_holding_baseline(self) -> list[int]:
        """The global ranks of the workers (every trainer rank's) that hold the
        baseline's version whole and can apply patches (the others need every
        tensor), ascending. Driver only."""
        delta = self.delta
        if delta is None:
            return []
        holders: list[int] = []
        engines = engines_of(self.generation)
        for index, engine in enumerate(engines):
            if not delta.holds(engine, self.weight_version):
                continue  # no baseline, or this engine discarded its weights since
            try:
                replies = await engine.collective_rpc(
                    "aiosync_ipc_held_version",
                    (self._session_token,),
                    timeout_s=self.rpc_timeout_s,
                )
            except Exception as exc:
                if len(engines) == 1:
                    raise
                # Asked member by member: name the engine, as the fleet's own calls do.
                label = f"engine {index} of {len(engines)} ({type(engine).__name__})"
                raise named(exc, label) from None
            for i, reply in enumerate(replies):
                _check_reply(reply, i, "aiosync_ipc_held_version")
                if reply.get("held") == delta.baseline.version and reply.get("patches"):
                    holders.append(int(reply["rank"]))
        return sorted(set(holders) & set(self._all_workers))

    async def _invalidate_workers(self, sync_id: str) -> None:
        """After a failed sync whose receive ran: if any worker loaded a byte of
        ``sync_id``, make every worker refuse to generate until a sync lands.

        A worker commits its version on its own ``end``; with a sharded trainer one
        rank may have committed its workers while another rank failed, and a
        failure after the stream (the colocated bracket's clean-up, the ranks'
        agreement) comes after every commit. Weights of two versions, or of the
        new one under the old label, must not serve. Shielded, bounded by
        ``timeouts.after_failure_s``; an error is logged (a dead worker comes back
        with its weights invalid anyway). Driver only.
        """
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeouts.after_failure_s):
            try:
                limit = self.timeouts.after_failure_s
                touched = await self.generation.collective_rpc(
                    "aiosync_ipc_invalidate", (sync_id, False), timeout_s=limit
                )
                if any(isinstance(r, dict) and r.get("touched") for r in touched):
                    await self.generation.collective_rpc(
                        "aiosync_ipc_invalidate", (sync_id, True), timeout_s=limit
                    )
            except Exception as exc:  # secondary: the sync's own error has the traceback
                _log.error(
                    "IPC: invalidating the workers after a failed sync failed: %s: %s",
                    type(exc).__name__,
                    exc,
                )

    async def _stream(
        self,
        sync_id: str,
        version: int,
        lanes: Sequence[_Lane],
        kv: list[tuple[str, float]],
        delta: dict[str, Any] | None = None,
        *,
        verify: Verify = False,
    ) -> int:
        assert self._sender is not None and self.plan is not None
        session: dict[str, Any] = {
            "endpoint": self._sender.endpoint,
            "sync_id": sync_id,
            "digest": self.plan.digest,
            "timeout_s": self.rpc_timeout_s,
            # The workers' receive is this synchronizer's alone (see OwnershipError).
            "owner": self._session_token,
            "version": version,
        }
        if delta is not None:
            session["delta"] = delta
        if self._endpoints is not None:
            session["endpoints"] = self._endpoints
        trainer_rows: list[dict[str, Any]] | None = None
        worker_rows: dict[int, list[dict[str, Any]]] = {}
        if self.trace:
            session["trace"] = True
            trainer_rows = []
        sender = self._sender
        sender.direct = self.direct
        peers = [rank for lane in lanes for rank in lane.ranks]
        result = 0
        results: list[dict[str, Any]] = []

        async def drive_receivers() -> None:
            # From here on a worker may load a byte of this sync (_invalidate_workers).
            self._receiving = True
            replies = await self.generation.collective_rpc(
                "aiosync_ipc_receive", (session,), timeout_s=self.sync_timeout_s
            )
            for rank, reply in enumerate(replies):
                _check_reply(reply, rank, "aiosync_ipc_receive")
                results.append({k: v for k, v in reply.items() if k != "trace"})
                if trainer_rows is not None:
                    worker_rows[int(reply.get("rank", rank))] = list(reply.get("trace") or [])

        # One worker, one trainer rank, a plan that fits the buffers without reusing
        # one: the whole refit goes inside the receive's session, no connection, one
        # round trip (the commit rule needs no ack: the one worker commits or not).
        # CPU only: a CUDA handle is bytes, and a session may travel as JSON (vLLM's
        # /collective_rpc).
        inline: list[dict[str, Any]] | None = None
        plan = lanes[0].plan if len(lanes) == 1 else None
        alone = (
            self.device.type == "cpu"
            and not self._ranks.sharded
            and delta is None
            and len(peers) == 1
            and plan is not None
        )
        if alone and plan is not None and sender.inlines(plan):
            inline = []
        # A larger plan goes inline too when every bucket of it goes direct: read the
        # direct buckets first (their refs; the source's tensors are not copied).
        ahead: _Ahead | None = None
        read_ahead = (
            alone
            and inline is None
            and sender.direct
            and not lanes[0].gathers
            and bool(lanes[0].plan.buckets)
            and lanes[0].plan.buckets[0].nbytes > 0  # a 0-byte bucket is sent as such
            and lanes[0].plan.total_bytes <= _INLINE_DIRECT_MAX_BYTES
        )

        async def send() -> None:
            nonlocal result
            result = await sender.send_lanes(
                sync_id,
                lanes,
                kv,
                trainer_rows,
                version=version,
                verify=verify,
                inline=inline,
                ahead=ahead,
            )

        try:
            if read_ahead:
                ahead = await sender.read_ahead(lanes[0], verify, version)
                if ahead.complete:
                    inline = []
            if inline is not None:
                # One after the other in this task: no task group to set up.
                await send()
                session["inline"] = inline
                # The receive's session commits the worker: a cancel asked for while
                # the buckets were read (in a thread, shielded) must end the sync here.
                # Later awaits may find their futures done and never yield to it.
                await anyio.lowlevel.checkpoint_if_cancelled()
                await drive_receivers()
            else:
                async with anyio.create_task_group() as tg:
                    if self._ranks.is_driver:
                        tg.start_soon(drive_receivers)
                    tg.start_soon(send)
        except BaseExceptionGroup as group:
            sender.abort(sync_id, peers, repr(group.exceptions[0]))
            if sender.closed:
                # The workers' replies merely echo the abort that shutdown sent.
                raise TransportError(_SHUT_DOWN_MID_SYNC) from most_telling(group)
            error = most_telling(group)
            error.__suppress_context__ = True  # the group; its own cause stays
            raise error from error.__cause__
        except BaseException as exc:
            sender.abort(sync_id, peers, repr(exc))
            if sender.closed and isinstance(exc, Exception):
                raise TransportError(_SHUT_DOWN_MID_SYNC) from exc
            raise
        if self._ranks.is_driver:
            self.last_worker_results = results
        if trainer_rows is not None:
            self.last_trace = {
                "clock": "time.monotonic",
                "trainer": trainer_rows,
                "workers": worker_rows,
            }
        return result

    async def close(self, sync: WeightSynchronizer) -> None:
        """Close the socket, remove its directory and unlink the buffers; tell the
        engine's workers to drop their mappings of the buffers (best effort, at
        most :data:`_RELEASE_TIMEOUT_S` seconds). Idempotent."""
        if self._sender is not None:
            sender, self._sender = self._sender, None
            await sender.aclose()
            if self._ranks.is_driver and self.generation is not None:
                await self._release_mappings()

    async def _release_mappings(self) -> None:
        """``aiosync_ipc_release`` on every worker; an error or a late answer is
        ignored (the workers then drop the mappings at their next receive)."""
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(_RELEASE_TIMEOUT_S),
            contextlib.suppress(Exception),
        ):
            await self.generation.collective_rpc(
                "aiosync_ipc_release", (self._session_token,), timeout_s=_RELEASE_TIMEOUT_S
            )

    @property
    def socket_dir(self) -> str | None:
        """The private (0700) directory holding the ``ipc://`` socket, None before init."""
        return None if self._sender is None else self._sender.directory
