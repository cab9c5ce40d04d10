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
import functools
import logging
import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

import anyio
import torch
import zmq
import zmq.asyncio

from aiosync._config import DEFAULT_EVENT_BACKLOG, Timeouts
from aiosync._digest import BlockDigest
from aiosync._fanout import most_telling, named
from aiosync._kv_scales import attention_layers, kv_scale_entries
from aiosync.capabilities import DiscardNotifier, InFlightPolicy, WorkerDescribing, engines_of
from aiosync.delta import DeltaBaseline, WeightPatch, patch_to_wire, wire_manifest
from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from aiosync.options import TransportCapabilities
from aiosync.sources import GathersInto, RefitManifest, RefitSource
from aiosync.synchronizer import KVScales, Transferred, WeightSynchronizer

from .._identity import CPU_LABEL, device_identity
from .._leftovers import dir_prefix, sweep_leftovers
from .._ranks import TrainerRanks, drain
from .._verify import Verify, bucket_digest, check_verify, sample_key, views_digest
from .._wire import decode, encode, error_fields, rebuild_error
from ..packing import (
    Bucket,
    BucketPlan,
    TensorSlot,
    group_by_bucket,
    in_place,
    pack,
    plan_buckets,
    slot_view,
)
from ._direct import DirectRef, direct_refs
from ._shm import EMPTY_HANDLE, SharedBuffer
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
#: How long a trainer that cannot reach a worker waits for the error the worker
#: sent before it closed its socket (usually queued already), seconds.
_WORKER_ERROR_GRACE_S = 1.0
_log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The largest refit sent inside the receive's session (one worker, see
#: ``_BucketSender.inlines``), bytes: its copy ends well within the 1 s a failed
#: sync's invalidation waits for a receive still running.
_INLINE_MAX_BYTES = 16 * 1024 * 1024
#: The largest inline refit read and packed on the event loop itself, bytes: its copy
#: takes well under the thread hop it saves (~0.1 ms of a ~1 ms sync's cost here).
_ON_LOOP_MAX_BYTES = 1024 * 1024
#: The largest refit sent inside the receive's session when every bucket of it goes
#: direct (only refs travel), bytes: one copy of it ends well within that 1 s too.
_INLINE_DIRECT_MAX_BYTES = 256 * 1024 * 1024

#: What a sync in flight raises when ``shutdown()`` interrupts it.
_SHUT_DOWN_MID_SYNC = "the IPC synchronizer was shut down during the sync"


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
        sync_timeout_s: overrides ``timeouts.sync_s``: the limit for a whole
            ``sync_weights``, seconds.
        timeouts: every limit (:class:`~aiosync.Timeouts`); default ``Timeouts()``.
        event_backlog: see :class:`~aiosync.WeightSynchronizer`.
        in_flight: what requests running on the engine do during a sync
            (``"wait"``, ``"abort"``, ``"keep"``; see :class:`~aiosync.WeightSynchronizer`).
        initial_version: where both versions start (a trainer resumed from its
            step-N checkpoint passes N); see :class:`~aiosync.WeightSynchronizer`.
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
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        verify=frozenset({False, "sample", True}),
        delta=True,
        trace=True,
        elastic=True,
        sharded_trainer=True,
        verify_engine=True,
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
        sync_timeout_s: float | None = None,
        timeouts: Timeouts | None = None,
        event_backlog: int = DEFAULT_EVENT_BACKLOG,
        in_flight: InFlightPolicy = "wait",
        initial_version: int = 0,
        process_group: Any = None,
        device_label: str | None = None,
        trace: bool = False,
        delta: bool = False,
        verify: Verify = True,
        direct: bool = True,
    ) -> None:
        # Every check before the base class's __init__, which registers the
        # discard listener on the engine: a refused synchronizer leaves none behind.
        verify = check_verify(verify)
        ranks = TrainerRanks(process_group)
        if ranks.is_driver and generation is None:
            raise ValueError("generation is None on the trainer rank that drives the engine")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if not 0 < buffer_memory_fraction <= 1:
            raise ValueError(
                f"buffer_memory_fraction must be in (0, 1], got {buffer_memory_fraction}"
            )
        if rpc_timeout_s is not None and not 0 < rpc_timeout_s < math.inf:
            raise ValueError(f"rpc_timeout_s must be a finite number > 0, got {rpc_timeout_s!r}")
        if isinstance(timeouts, Timeouts):
            timeouts = timeouts.with_keywords(rpc_timeout_s=rpc_timeout_s)
        elif timeouts is None and rpc_timeout_s is not None:
            timeouts = Timeouts(rpc_s=rpc_timeout_s)
        super().__init__(
            policy,
            generation,
            timeouts=timeouts,
            sync_timeout_s=sync_timeout_s,
            event_backlog=event_backlog,
            in_flight=in_flight,
            initial_version=initial_version,
            ranks=ranks,
        )
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
        #: What the workers hold, for delta syncs (None: ``delta=False``).
        self.delta_baseline: DeltaBaseline | None = DeltaBaseline() if delta else None
        # Delta only: each engine's weight discards so far (its workers' weights
        # cannot be trusted to be the baseline's after one: even an engine whose
        # workers keep no discard epoch reports them), and as of the sync that
        # committed the baseline, and as of the sync in flight.
        # Keyed by id(engine): a fleet's members may change (quarantine, add_engine).
        self._engine_discards: dict[int, int] = {}
        self._baseline_discards: dict[int, int] = {}
        self._sync_discards: dict[int, int] = {}
        self._discard_hooks: list[tuple[DiscardNotifier, Callable[[], None]]] = []
        if delta and generation is not None:
            self._hook_discards()
            self._baseline_discards = self._sync_discards = dict(self._engine_discards)

    def _hook_discards(self) -> None:
        """Count each engine's weight discards (delta only; engines a fleet gained since
        are hooked when its membership changes, and get every tensor until a commit)."""
        for engine in engines_of(self.generation):
            if id(engine) in self._engine_discards:
                continue
            self._engine_discards[id(engine)] = 0
            if isinstance(engine, DiscardNotifier):
                hook = functools.partial(self._engine_discarded, id(engine))
                engine.add_weights_discarded_listener(hook)
                self._discard_hooks.append((engine, hook))

    async def _membership_changed(self) -> None:
        """The fleet's engines changed: a fresh socket and buffers (the workers
        renumbered, no state of the failed round carries over), then re-init."""
        if self.delta_baseline is not None:
            self._hook_discards()
        if self._sender is not None:
            sender, self._sender = self._sender, None
            self.plan = None
            await sender.aclose()
        await super()._membership_changed()

    @property
    def rpc_timeout_s(self) -> float:
        """The limit for every single wait, seconds (``timeouts.rpc_s``)."""
        return self.timeouts.rpc_s

    async def init_communicator(self) -> None:
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
        await super().init_communicator()

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

    async def _transfer(self, version: int, kv_scales: KVScales | None) -> Transferred:
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
        baseline = self.delta_baseline
        if baseline is None:
            return [_Lane(self.plan, self.peers, weights, gathers)], None
        self._sync_discards = dict(self._engine_discards)
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
        wire_plan, wires, patches, spec = await anyio.to_thread.run_sync(
            self._diff, baseline, self.plan, weights
        )
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
        baseline = self.delta_baseline
        if baseline is None or baseline.version is None:
            return []
        if baseline.version != self.weight_version:
            return []
        holders: list[int] = []
        engines = engines_of(self.generation)
        for index, engine in enumerate(engines):
            key = id(engine)
            if key not in self._baseline_discards or (
                self._sync_discards.get(key) != self._baseline_discards[key]
            ):
                continue  # this engine discarded its weights since the baseline
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
                if reply.get("held") == baseline.version and reply.get("patches"):
                    holders.append(int(reply["rank"]))
        return sorted(set(holders) & set(self._all_workers))

    @staticmethod
    def _diff(
        baseline: DeltaBaseline, plan: BucketPlan, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> tuple[BucketPlan, list[tuple[str, torch.Tensor]], list[WeightPatch], dict[str, Any]]:
        """The patches from the baseline to ``weights`` (blocking): their wire plan
        (``plan``'s bucket size), wire tensors, the patches and the workers' ``delta``
        session entry (without ``ranks``)."""
        patches = list(baseline.diff(weights))
        wires = [patch_to_wire(p) for p in patches]
        metas = [meta for meta, _ in wires]
        wire_plan = plan_buckets(wire_manifest(metas, plan.manifest()), plan.bucket_bytes)
        spec = {"base": baseline.version, "patches": metas, "digest": wire_plan.digest}
        return wire_plan, [t for _, tensors in wires for t in tensors], patches, spec

    def _sync_outcome(self, version: int, *, committed: bool) -> None:
        baseline = self.delta_baseline
        if baseline is None:
            return
        if committed:
            baseline.commit()
            self._baseline_discards = self._sync_discards
        else:
            baseline.invalidate()

    def _live_check_failed(self) -> None:
        # A worker's weights are not the baseline's version any more: every worker
        # gets every tensor at the next sync, which heals it and stages a new baseline.
        if self.delta_baseline is not None:
            self.delta_baseline.invalidate()

    def _engine_discarded(self, key: int) -> None:
        """The engine of ``id()`` ``key`` dropped its workers' weights (a listener, delta only)."""
        self._engine_discards[key] = self._engine_discards.get(key, 0) + 1

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

    async def shutdown(self) -> None:
        """Close the socket, remove its directory and unlink the buffers; tell the
        engine's workers to drop their mappings of the buffers (best effort, at
        most :data:`_RELEASE_TIMEOUT_S` seconds). Idempotent."""
        for engine, hook in self._discard_hooks:
            engine.remove_weights_discarded_listener(hook)
        self._discard_hooks = []
        if self._sender is not None:
            sender, self._sender = self._sender, None
            await sender.aclose()
            if self._ranks.is_driver and self.generation is not None:
                await self._release_mappings()
        await super().shutdown()

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


def _check_reply(reply: Any, rank: int, method: str) -> None:
    if not isinstance(reply, dict):
        raise TransportError(f"engine worker {rank}: malformed {method} reply {reply!r:.80}")
    if not reply.get("ok"):
        raise rebuild_error(reply, f"engine worker {rank} ({method})")


class _BucketSender:
    """The trainer's socket and staging buffers; streams one plan's buckets per call.

    Made by :meth:`open`, which takes ownership of ``directory`` and ``buffers``.
    """

    def __init__(
        self,
        plan: BucketPlan,
        device: torch.device,
        timeout_s: float,
        device_id: str,
        directory: str,
        buffers: list[SharedBuffer],
    ) -> None:
        self.plan = plan
        self.device = device
        self.device_id = device_id
        self.timeout_s = timeout_s
        self.directory = directory
        self._buffers = buffers
        self.endpoint = f"ipc://{self.directory}/refit.sock"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        # A synchronous twin of the socket: a NOBLOCK send on it raises at once
        # (an asyncio socket's returns a future whose error nobody would read).
        self._sync_sock: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self._closed = False
        # The socket identity of the last message received, and the identities of
        # the current sync's workers (``(sync_id, {rank: identity})``, see _handshake).
        self._last_ident = b""
        self._idents: tuple[str, dict[int, bytes]] = ("", {})
        # Each worker's identity as last heard: a worker keeps its socket from one
        # sync to the next, so an abort must reach that identity too.
        self._known_idents: dict[int, bytes] = {}
        #: Whether a bucket of arena tensors goes direct (set per sync by the synchronizer).
        self.direct = False
        #: The messages of the inline sync running (see :meth:`send_lanes`), else None.
        self._inline: list[dict[str, Any]] | None = None
        # Whether this sync's source reads and packing run on the event loop (_in_thread).
        self._on_loop = False
        # The slots and buffer of the bucket the source is reading (see destination).
        self._into: tuple[dict[str, TensorSlot], torch.Tensor] | None = None
        #: Names a worker in an error it sent (a fleet names its engine too).
        self.describe_worker: Callable[[int], str] = lambda rank: f"engine worker {rank}"
        # The send in flight: its cancel scope, its sync, and an event set when it ends.
        self._active: tuple[anyio.CancelScope, str, Sequence[int], anyio.Event] | None = None

    @classmethod
    async def open(
        cls, plan: BucketPlan, device: torch.device, timeout_s: float, device_id: str = CPU_LABEL
    ) -> _BucketSender:
        """Sweep the leftovers of dead processes, make the socket's private
        directory and the staging buffers (in a worker thread: the sweep walks
        directories, a buffer may be gigabytes), then bind the socket.

        Raises:
            TransportError: a buffer cannot be shared (see ``transports/_shm.py``).
            OSError: the directory or a segment cannot be created.
        """
        directory, buffers = await anyio.to_thread.run_sync(_stage, plan, device)
        try:
            return cls(plan, device, timeout_s, device_id, directory, buffers)
        except BaseException:
            _release(directory, buffers)
            raise

    async def send(
        self,
        sync_id: str,
        ranks: Sequence[int],
        weights: Iterator[tuple[str, torch.Tensor]],
        kv: Sequence[tuple[str, float]] = (),
        trace: list[dict[str, Any]] | None = None,
        *,
        version: int = 0,
        verify: Verify = True,
    ) -> int:
        """Stream every bucket of the plan, then the KV-cache scales ``kv`` (engine
        names, values), to the workers of global ``ranks``; returns the bytes sent.
        ``trace``: a list that gets one row of ``time.monotonic()`` timestamps per
        bucket (see :attr:`IPCWeightSynchronizer.last_trace`); None records nothing.
        ``verify``: how each bucket's digest is computed (``False``: none is sent),
        its sample seeded by ``version`` and the bucket's index (:func:`sample_key`).

        With no ranks (a sharded trainer's rank whose device holds no worker) the
        source is still iterated to its end: its gathers are collectives.

        Raises:
            TransportError: the synchronizer was shut down during the sync
                (:meth:`aclose`), a worker is unreachable or sent garbage.
            SyncTimeoutError, RefitMismatchError: see the module docs.
        """
        lanes = [_Lane(self.plan, ranks, weights)]
        return await self.send_lanes(sync_id, lanes, kv, trace, version=version, verify=verify)

    async def send_lanes(
        self,
        sync_id: str,
        lanes: Sequence[_Lane],
        kv: Sequence[tuple[str, float]] = (),
        trace: list[dict[str, Any]] | None = None,
        *,
        version: int = 0,
        verify: Verify = True,
        inline: list[dict[str, Any]] | None = None,
        ahead: _Ahead | None = None,
    ) -> int:
        """:meth:`send`, each lane's buckets (its own plan, e.g. a delta's wire plan)
        to its own workers, one lane after the other over the same buffers; one
        hello before and one ``end`` after, for every lane's workers. Returns the
        bytes packed (each lane's once, however many workers read it). ``inline``
        (a plan that :meth:`fits_without_reuse`, or whose every bucket went direct;
        one worker): the messages go into this list instead, ``end`` last, for the
        receive's session; nothing is sent. ``ahead``: what :meth:`read_ahead` read
        of the first lane."""
        if self._closed:
            raise TransportError("the IPC synchronizer was shut down")
        ended = anyio.Event()
        ranks = [rank for lane in lanes for rank in lane.ranks]
        with anyio.CancelScope() as scope:
            self._active = (scope, sync_id, ranks, ended)
            try:
                check = _Check(verify, version)
                self._inline = inline
                try:
                    return await self._send(sync_id, lanes, kv, trace, check, ahead)
                finally:
                    self._inline = None
            finally:
                self._active = None
                ended.set()
        raise TransportError(_SHUT_DOWN_MID_SYNC)

    async def _send(
        self,
        sync_id: str,
        lanes: Sequence[_Lane],
        kv: Sequence[tuple[str, float]],
        trace: list[dict[str, Any]] | None,
        check: _Check,
        ahead: _Ahead | None = None,
    ) -> int:
        ranks = [rank for lane in lanes for rank in lane.ranks]
        if not ranks:
            for lane in lanes:
                await anyio.to_thread.run_sync(drain, lane.weights)
            return 0
        inline = self._inline is not None
        self._on_loop = inline and sum(lane.plan.total_bytes for lane in lanes) <= (
            _ON_LOOP_MAX_BYTES
        )
        peers = dict.fromkeys(ranks, b"") if inline else await self._handshake(sync_id, ranks)
        stream = _Stream(holder=[None] * len(self._buffers), rows={} if trace is not None else None)
        nbytes = 0
        for lane in lanes:
            if not lane.ranks:
                await anyio.to_thread.run_sync(drain, lane.weights)
                continue
            audience = {rank: peers[rank] for rank in lane.ranks}
            nbytes += await self._send_lane(sync_id, lane, audience, stream, trace, check, ahead)
            ahead = None
        for seq in range(len(stream.audience) if not inline else 0):
            await self._wait_acks(sync_id, stream, seq)
        end = {
            "t": "end",
            "sync_id": sync_id,
            "buckets": len(stream.audience),
            "kv_scales": [[name, value] for name, value in kv],
        }
        await self._send_all(sync_id, peers, end)
        if inline:
            return nbytes  # the receive's reply is the worker's "done"
        done: set[int] = set()
        while len(done) < len(peers):
            rank, msg = await self._recv(sync_id, "the end of the refit")
            if msg.get("t") == "done":
                done.add(rank)
        return nbytes

    async def _send_lane(
        self,
        sync_id: str,
        lane: _Lane,
        peers: dict[int, bytes],
        stream: _Stream,
        trace: list[dict[str, Any]] | None,
        check: _Check,
        first: _Ahead | None = None,
    ) -> int:
        """Pack and send every bucket of ``lane`` to ``peers``, numbering them on
        from the buckets ``stream`` holds (each with its digest, as ``check``
        says), the first ones from ``first`` when given (:meth:`read_ahead`);
        returns the bytes packed."""
        plan = lane.plan
        groups = group_by_bucket(lane.weights, plan) if first is None else first.groups
        nbytes = 0
        count = len(plan.buckets)
        fits = self._fits
        # The next bucket's tensors when a direct run read them and they are not direct.
        ahead: list[tuple[str, torch.Tensor]] | None = None
        # Direct buckets read per thread hop: 1, 2, 4, ... so the first goes out at
        # once and the trainer's digests keep ahead of the workers' copies.
        batch = 1
        i = 0
        while i < count:
            bucket = plan.buckets[i]
            seq = len(stream.audience)
            stream.audience.append(peers)
            # group_by_bucket yields the plan's buckets in order: ``bucket`` is known
            # before the source is read, so its buffer can be chosen first.
            row = _trace_row(stream, trace, seq, bucket)
            last = i == count - 1
            data = {
                "t": "data",
                "sync_id": sync_id,
                "seq": seq,
                "bucket": bucket.index,
                "device": self.device_id,
            }
            i += 1
            if bucket.nbytes == 0:
                # Only zero-size tensors (already checked against their slots by
                # group_by_bucket): nothing to pack, and no 0-byte segment exists.
                await self._in_thread(self._read_and_pack, groups, None, None, last, row)
                if row is not None:
                    row["copied"] = 0
                _stamp(row, "sent")
                await self._send_all(sync_id, peers, {**data, "handle": dict(EMPTY_HANDLE)})
                continue
            group, ahead = ahead, None
            # The digest of a bucket packed in the direct read's hop (a 1-tuple), else None.
            packed: tuple[int | None] | None = None
            spare: SharedBuffer | None = None
            if first is not None or (self.direct and group is None and not lane.gathers):
                if first is not None:
                    # Read before the handshake (read_ahead): the lane's first buckets.
                    run, group, packed = first.run, first.group, None
                    first = None
                else:
                    # Whether a bucket goes direct depends on its tensors: read them
                    # first, and the direct buckets after it in the same thread hop
                    # (their refs copy nothing), so the trainer keeps off the CPUs the
                    # workers copy on. A bucket that is not direct is packed in that
                    # hop too when its buffer is free (no second hop).
                    if bucket.nbytes <= fits:
                        previous = stream.holder[seq % len(self._buffers)]
                        if previous is None or stream.acked(previous):
                            spare = self._buffers[seq % len(self._buffers)]
                    run, group, packed = await self._in_thread(
                        self._read_direct,
                        groups,
                        plan.buckets[i - 1 : i - 1 + batch],
                        check,
                        row,
                        count - i + 1,
                        spare,
                    )
                    batch *= 2
                for k, direct in enumerate(run):
                    if k:
                        bucket, seq = plan.buckets[i], len(stream.audience)
                        stream.audience.append(peers)
                        row = _trace_row(stream, trace, seq, bucket)
                        i += 1
                    # Nothing waits on a direct bucket's ack (no buffer to free): the
                    # worker sends none; its errors and ``done`` still come.
                    stream.unacked.add(seq)
                    message = {**data, "seq": seq, "bucket": bucket.index, "ack": False}
                    if direct.digest is not None:
                        message.update(check.fields(bucket, direct.digest))
                    if row is not None:
                        row.update(pack_start=direct.read_start, pack_end=direct.read_end, copied=0)
                    _stamp(row, "sent")
                    message["direct"] = direct.refs
                    await self._send_all(sync_id, peers, message)
                    nbytes += sum(s.nbytes for s in bucket.slots)
                if run:
                    ahead = group  # the next bucket's (not direct), or None
                    continue
                # This bucket is not direct: packed into ``spare`` already, or ``group``
                # holds its tensors, packed below.
            transient: SharedBuffer | None = None
            if packed is not None:
                assert spare is not None
                buffer = spare
                stream.holder[seq % len(self._buffers)] = seq
            elif bucket.nbytes > fits:
                transient = await anyio.to_thread.run_sync(
                    SharedBuffer.create, bucket.nbytes, self.device
                )
                buffer = transient
            else:
                slot = seq % len(self._buffers)
                previous = stream.holder[slot]
                if previous is not None and not stream.acked(previous):
                    # Read the source while the workers still load the bucket that
                    # holds this buffer; pack once they acknowledged it. A source that
                    # gathers into the buffer waits for it instead.
                    if group is None and not lane.gathers:
                        group, _ = await self._in_thread(
                            self._read_and_pack, groups, None, None, False, row
                        )
                    await self._wait_acks(sync_id, stream, previous)
                buffer = self._buffers[slot]
                stream.holder[slot] = seq
            try:
                if packed is None:
                    # One thread hop reads the source (unless read above), packs, digests,
                    # and after the last bucket checks that the source ended.
                    _, digest = await self._in_thread(
                        self._read_and_pack, groups, group, buffer, last, row, bucket, check
                    )
                else:
                    (digest,) = packed
                del group
                handle = buffer.handle()
                if transient is not None:
                    handle["transient"] = True
                if digest is not None:
                    data.update(check.fields(bucket, digest))
                _stamp(row, "sent")
                await self._send_all(sync_id, peers, {**data, "handle": handle})
                nbytes += sum(s.nbytes for s in bucket.slots)
                if transient is not None:
                    await self._wait_acks(sync_id, stream, seq)
            finally:
                if transient is not None:
                    transient.close()
        if count == 0:
            # The source must be exhausted exactly at the plan's end.
            await self._in_thread(_exhaust, groups)
        return nbytes

    async def _in_thread(self, func: Callable[..., _T], *args: Any) -> _T:
        """``func(*args)`` in a worker thread: it reads the source and copies. A refit
        of at most :data:`_ON_LOOP_MAX_BYTES` sent inline runs it on the event loop:
        a thread hop costs more than its copy."""
        if self._on_loop:
            return func(*args)
        return await anyio.to_thread.run_sync(func, *args)

    async def read_ahead(self, lane: _Lane, verify: Verify, version: int) -> _Ahead:
        """Read ``lane``'s buckets from its first while they go direct, in one thread
        hop (the refs and digests :meth:`_read_direct` takes; nothing is copied), so
        that a refit whose every bucket goes direct can travel inline. What was read
        goes to :meth:`send_lanes` (``ahead=``), which sends it and reads on."""
        groups = group_by_bucket(lane.weights, lane.plan)
        buckets = lane.plan.buckets
        run, group, _ = await anyio.to_thread.run_sync(
            self._read_direct, groups, buckets, _Check(verify, version), None, len(buckets)
        )
        return _Ahead(groups, run, group, group is None and len(run) == len(buckets))

    def _read_direct(
        self,
        groups: Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]]]],
        buckets: Sequence[Bucket],
        check: _Check,
        row: dict[str, Any] | None,
        remaining: int,
        spare: SharedBuffer | None = None,
    ) -> tuple[
        list[_DirectBucket], list[tuple[str, torch.Tensor]] | None, tuple[int | None] | None
    ]:
        """In a worker thread: read ``buckets[0]`` from the source and, while each
        bucket read goes direct, the next non-empty ones of ``buckets``. Returns the
        direct run (refs, digest, when it was read), the tensors of the bucket that
        ended it by not going direct (None otherwise), and, when ``buckets[0]`` is not
        direct and ``spare`` (a free buffer) is given, ``(its digest,)`` after packing
        it into ``spare`` instead of returning its tensors. ``remaining``: the plan's
        buckets from ``buckets[0]`` on; after its last the source is checked ended."""
        run: list[_DirectBucket] = []
        for k, bucket in enumerate(buckets):
            if k and bucket.nbytes == 0:
                break
            start = time.monotonic()
            _bucket, group = next(groups)
            if k == remaining - 1:
                _exhaust(groups)
            refs = direct_refs(group, self.device)
            if refs is None:
                if k == 0 and row is not None:
                    row["pack_start"] = start
                if k == 0 and spare is not None:
                    _, digest = self._read_and_pack(groups, group, spare, False, row, bucket, check)
                    return run, None, (digest,)
                return run, group, None
            if self.device.type == "cuda":
                # What the last optimizer step queued on the stream is written before
                # a worker reads the trainer's memory.
                torch.cuda.current_stream(self.device).synchronize()
            digest = None if check.verify is False else check.views_digest(bucket, group)
            run.append(_DirectBucket(refs, digest, start, time.monotonic()))
        return run, None, None

    def _read_and_pack(
        self,
        groups: Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]]]],
        group: list[tuple[str, torch.Tensor]] | None,
        buffer: SharedBuffer | None,
        last: bool,
        row: dict[str, Any] | None,
        bucket: Bucket | None = None,
        check: _Check | None = None,
    ) -> tuple[list[tuple[str, torch.Tensor]] | None, int | None]:
        """In a worker thread: read the next bucket's tensors from the source
        unless ``group`` holds them, pack them into ``buffer`` (None: return them
        unpacked), digest the packed bucket as ``check`` says, and after the
        ``last`` bucket check that the source ended. Returns ``(the tensors when
        not packed, the digest when computed)``. ``row`` gets
        ``pack_start``/``pack_end`` (``time.monotonic()``; the digest is inside) and
        ``copied``, the bytes packing copied (a tensor gathered into its slot is not).
        While the source reads a bucket for ``buffer`` it may gather into it
        (:meth:`destination`)."""
        if row is not None and "pack_start" not in row:
            row["pack_start"] = time.monotonic()
        if group is None:
            if buffer is not None:
                assert bucket is not None
                # What :meth:`destination` offers while the source reads this bucket.
                self._into = ({slot.name: slot for slot in bucket.slots}, buffer.tensor)
            try:
                _bucket, group = next(groups)
            finally:
                self._into = None
        digest = None
        if buffer is not None:
            assert bucket is not None
            if row is not None:
                row["copied"] = sum(
                    slot.nbytes
                    for slot, (_name, tensor) in zip(bucket.slots, group, strict=False)
                    if not in_place(tensor, slot_view(buffer.tensor, slot))
                )
            # verify=True: digested as it is packed, each chunk while still in cache.
            blocks = BlockDigest() if check is not None and check.verify is True else None
            self._pack(bucket, group, buffer, blocks)
            if blocks is not None:
                digest = blocks.value()
            elif check is not None:
                digest = check.digest(bucket, buffer.tensor)
        if last:
            _exhaust(groups)
        _stamp(row, "pack_end")
        return (group if buffer is None else None), digest

    def _pack(
        self,
        bucket: Bucket,
        group: list[tuple[str, torch.Tensor]],
        buffer: SharedBuffer,
        digest: BlockDigest | None = None,
    ) -> None:
        pack(bucket, group, out=buffer.tensor, digest=digest)
        if buffer.tensor.is_cuda:
            torch.cuda.current_stream(buffer.tensor.device).synchronize()

    def destination(self, name: str) -> torch.Tensor | None:
        """Where a :class:`~aiosync.interfaces.GathersInto` source may gather tensor
        ``name``: its slot of the buffer the bucket being read is packed into (a view of
        the slot's shape and dtype), None when no buffer waits for it. Called in the
        packing thread, from inside the source."""
        into = self._into
        if into is None:
            return None
        slots, buffer = into
        slot = slots.get(name)
        return None if slot is None else slot_view(buffer, slot)

    @property
    def _fits(self) -> int:
        """The largest bucket a ping-pong buffer holds, bytes: a buffer fits the largest
        regular bucket of the plan it was made for; a bigger bucket (an oversized
        tensor, a wire plan's) gets a buffer of its own."""
        return min((b.nbytes for b in self._buffers), default=0)

    def fits_without_reuse(self, plan: BucketPlan) -> bool:
        """Whether every bucket of ``plan`` gets a buffer of its own: no buffer is
        reused within a sync and none is made for it, so no bucket waits for an ack."""
        return len(plan.buckets) <= len(self._buffers) and all(
            b.nbytes <= self._fits for b in plan.buckets
        )

    def inlines(self, plan: BucketPlan) -> bool:
        """Whether a refit of ``plan`` to one worker goes inside its session: it
        :meth:`fits_without_reuse` and is small (:data:`_INLINE_MAX_BYTES`), so
        that a cancelled one ends on the worker before the invalidation's wait."""
        return self.fits_without_reuse(plan) and plan.total_bytes <= _INLINE_MAX_BYTES

    async def _handshake(self, sync_id: str, ranks: Sequence[int]) -> dict[int, bytes]:
        """Wait for every worker's ``hello``; returns each rank's socket identity.

        A worker names its socket after the sync that opened it (``{sync_id}/{rank}``)
        and keeps it for later syncs of this synchronizer, so the identity is
        the hello's, not this sync's name.
        """
        expected = set(ranks)
        peers: dict[int, bytes] = {}
        self._idents = (sync_id, peers)
        while len(peers) < len(expected):
            rank, msg = await self._recv(sync_id, "the engine workers to connect")
            if msg.get("t") != "hello":
                continue
            if rank not in expected:
                raise TransportError(
                    f"engine worker {rank} connected to the trainer rank of device "
                    f"{self.device_id}, which does not serve it"
                )
            if msg.get("digest") != self.plan.digest:
                raise RefitMismatchError(
                    f"engine worker {rank} holds bucket plan {str(msg.get('digest'))[:16]}, "
                    f"the trainer sends {self.plan.digest[:16]}"
                )
            peers[rank] = self._known_idents[rank] = self._last_ident
        return peers

    async def _wait_acks(self, sync_id: str, stream: _Stream, seq: int) -> None:
        """Receive until every worker bucket ``seq`` went to acknowledged it; the
        acks of other buckets that arrive meanwhile are recorded too (a traced
        row's ``acked`` becomes the time the last of its workers' acks arrived)."""
        while not stream.acked(seq):
            rank, msg = await self._recv(sync_id, f"acknowledgements of bucket {seq}")
            if msg.get("t") == "ack":
                try:
                    acked = int(msg["seq"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise TransportError(
                        f"engine worker {rank}: malformed ack {msg!r:.80}"
                    ) from exc
                stream.acks.setdefault(acked, set()).add(rank)
                rows = stream.rows
                if rows is not None and acked in rows and stream.acked(acked):
                    _stamp(rows[acked], "acked")

    async def _recv(self, sync_id: str, what: str) -> tuple[int, dict[str, Any]]:
        """The next message of this sync; worker errors are raised, other syncs' dropped."""
        while True:
            try:
                with anyio.fail_after(self.timeout_s):
                    frames = await self._sock.recv_multipart()
            except TimeoutError as exc:
                raise SyncTimeoutError(f"waited {self.timeout_s} s for {what}") from exc
            if len(frames) != 2:
                raise TransportError(f"malformed message of {len(frames)} frames")
            msg = decode(frames[1])
            self._last_ident = frames[0]
            if msg.get("sync_id") != sync_id:
                continue  # a late message of an earlier, failed sync
            rank = msg.get("rank")
            if rank is None:
                ident = frames[0].decode(errors="replace")
                rank = ident.rpartition("/")[2]
            try:
                rank = int(rank)
            except (TypeError, ValueError) as exc:
                raise TransportError(f"message from an unknown peer: {msg!r:.80}") from exc
            if msg.get("t") == "error":
                raise rebuild_error(msg, self.describe_worker(rank))
            return rank, msg

    async def _send_all(
        self, sync_id: str, peers: dict[int, bytes], message: dict[str, Any]
    ) -> None:
        """Send ``message`` to every peer (or, in an inline sync, keep it for the session)."""
        if self._inline is not None:
            self._inline.append(message)
            return
        payload = encode(message)
        for rank, ident in peers.items():
            try:
                await self._sock.send_multipart([ident, payload])
            except zmq.ZMQError as exc:
                raise await self._why_unreachable(sync_id, rank, exc) from exc

    async def _why_unreachable(self, sync_id: str, rank: int, exc: zmq.ZMQError) -> Exception:
        """What to raise when worker ``rank`` of ``sync_id`` cannot be sent to.

        A worker whose receive fails sends its error, then closes its socket; the
        trainer may be sending it the next bucket by then. That error (e.g. a
        :class:`~aiosync.errors.RefitVerificationError`) is the cause: it is still
        queued on the socket, and returned if any worker's of this sync arrives
        within :data:`_WORKER_ERROR_GRACE_S` seconds; else a :class:`TransportError`.
        """
        unreachable = TransportError(f"engine worker {rank} is unreachable: {exc}")
        try:
            with anyio.fail_after(min(_WORKER_ERROR_GRACE_S, self.timeout_s)):
                while True:
                    await self._recv(sync_id, "the error of an unreachable worker")
        except (TimeoutError, SyncTimeoutError):
            return unreachable
        except Exception as error:  # the worker's, re-typed by _recv
            return error

    def abort(self, sync_id: str, ranks: Sequence[int], reason: str) -> None:
        """Tell the workers of ``sync_id`` to stop waiting (best effort, never raises)."""
        if self._closed:
            return
        payload = encode({"t": "abort", "sync_id": sync_id, "reason": reason[:500]})
        # The identities the workers said hello from; a worker not heard from yet
        # would connect as ``{sync_id}/{rank}`` (a new socket) or reuse the one it
        # kept from an earlier sync: both are told, or its receive would wait the
        # whole timeout (holding the worker from the next sync).
        known = self._idents[1] if self._idents[0] == sync_id else {}
        for rank in ranks:
            idents = {known.get(rank, f"{sync_id}/{rank}".encode())}
            if rank in self._known_idents:
                idents.add(self._known_idents[rank])
            for ident in idents:
                with contextlib.suppress(zmq.ZMQError):  # not connected (yet, or any more)
                    self._sync_sock.send_multipart([ident, payload], zmq.NOBLOCK)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    async def aclose(self) -> None:
        """Stop the send in flight (it raises :class:`TransportError` naming the
        shutdown; its workers are told to abort), wait up to ``timeout_s`` seconds
        for it to let go of the buffers, then :meth:`close`."""
        active = self._active
        if active is not None and not self._closed:
            scope, sync_id, ranks, ended = active
            self.abort(sync_id, ranks, "the IPC synchronizer was shut down")
            scope.cancel()
            with anyio.move_on_after(self.timeout_s):
                await ended.wait()
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        buffers, self._buffers = self._buffers, []
        self._sock.close(linger=0)
        self._ctx.term()
        _release(self.directory, buffers)


def _stage(plan: BucketPlan, device: torch.device) -> tuple[str, list[SharedBuffer]]:
    """The sender's private (0700) socket directory and its ping-pong buffers."""
    # A trainer killed earlier (SIGKILL runs no cleanup) left its segments and
    # socket directory behind; they carry its pid, so the dead ones go now.
    sweep_leftovers()
    directory = tempfile.mkdtemp(prefix=dir_prefix("ipc"))
    buffers: list[SharedBuffer] = []
    try:
        os.chmod(directory, 0o700)
        # Two buffers sized to the largest bucket that respects the limit; an
        # oversized (single-tensor) bucket gets its own buffer when it comes.
        regular = [b.nbytes for b in plan.buckets if b.nbytes <= plan.bucket_bytes]
        size = max(regular, default=0)
        for _ in range(min(2, len(regular)) if size else 0):
            buffers.append(SharedBuffer.create(size, device))
    except BaseException:
        _release(directory, buffers)
        raise
    return directory, buffers


def _release(directory: str, buffers: Sequence[SharedBuffer]) -> None:
    """Unlink ``buffers`` and remove ``directory`` (and the socket file in it)."""
    for buffer in buffers:
        buffer.close()
    shutil.rmtree(directory, ignore_errors=True)


class _Check(NamedTuple):
    """How one sync digests its packed buckets (:mod:`aiosync.transports._verify`)."""

    verify: Verify
    #: The weight version sent: with the bucket's index, the sample's seed.
    version: int

    def digest(self, bucket: Bucket, buffer: torch.Tensor) -> int | None:
        """The digest of ``bucket`` packed at the start of ``buffer`` (``uint8``,
        at least ``bucket.nbytes`` bytes; padding between slots included, it is the
        same memory the workers read); None with ``verify=False``."""
        if self.verify is False:
            return None
        return bucket_digest(
            buffer[: bucket.nbytes],
            self.verify,
            key=sample_key(self.version, bucket.index),
            slots=[(s.offset, s.nbytes) for s in bucket.slots],
        )

    def views_digest(self, bucket: Bucket, group: Sequence[tuple[str, torch.Tensor]]) -> int:
        """The digest of a direct bucket: its tensors' own bytes, in slot order, at
        their slots' offsets (:func:`~aiosync.transports._verify.views_digest`; blocking)."""
        assert self.verify is not False
        views = [t.detach().reshape(-1).view(torch.uint8) for _name, t in group]
        return views_digest(
            views,
            self.verify,
            key=sample_key(self.version, bucket.index),
            offsets=[slot.offset for slot in bucket.slots],
        )

    def fields(self, bucket: Bucket, digest: int) -> dict[str, Any]:
        """What a ``data`` message carries for the worker's check: the mode, the
        sample's seed and the digest (a signed int64)."""
        return {
            "verify": self.verify,
            "key": sample_key(self.version, bucket.index),
            "digest": digest,
        }


class _Ahead(NamedTuple):
    """What :meth:`_BucketSender.read_ahead` read of a lane before its sync started."""

    #: The lane's ``group_by_bucket``, positioned after what was read.
    groups: Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]]]]
    #: The direct buckets from the lane's first on.
    run: list[_DirectBucket]
    #: The tensors of the bucket after them, when it did not go direct (else None).
    group: list[tuple[str, torch.Tensor]] | None
    #: Whether every bucket of the lane went direct (the source is checked ended).
    complete: bool


class _DirectBucket(NamedTuple):
    """A bucket sent direct: where its tensors lie, its digest (None: not checked),
    and when reading it from the source started and ended (``time.monotonic()``)."""

    refs: list[DirectRef]
    digest: int | None
    read_start: float
    read_end: float


class _Lane(NamedTuple):
    """Buckets of one plan for some of the workers: every tensor (the refit's plan)
    or a delta's patches (their wire plan, :mod:`aiosync.delta`)."""

    plan: BucketPlan
    #: Global ranks of the workers that get them.
    ranks: Sequence[int]
    #: The plan's tensors, in order.
    weights: Iterator[tuple[str, torch.Tensor]]
    #: Whether ``weights`` gathers into :meth:`_BucketSender.destination`: each bucket
    #: is read once its buffer is free, and never direct (a gathered tensor is new).
    gathers: bool = False


@dataclass(eq=False)
class _Stream:
    """One sync's buckets across its lanes, numbered ``seq`` in send order."""

    #: The seq each ping-pong buffer holds (None: free).
    holder: list[int | None]
    #: Trace rows by seq (None: not tracing).
    rows: dict[int, dict[str, Any]] | None = None
    #: The workers (rank: socket identity) each seq went to.
    audience: list[dict[int, bytes]] = field(default_factory=list)
    #: The ranks that acknowledged each seq.
    acks: dict[int, set[int]] = field(default_factory=dict)
    #: The seqs sent without asking for an ack (direct buckets).
    unacked: set[int] = field(default_factory=set)

    def acked(self, seq: int) -> bool:
        """Whether every worker bucket ``seq`` went to acknowledged it (or it asked none)."""
        return seq in self.unacked or self.acks.get(seq, set()) >= set(self.audience[seq])


def _trace_row(
    stream: _Stream, trace: list[dict[str, Any]] | None, seq: int, bucket: Bucket
) -> dict[str, Any] | None:
    """A new trace row for bucket ``seq`` (recorded in ``trace`` and the stream);
    None when not tracing."""
    if trace is None or stream.rows is None:
        return None
    row = {"seq": seq, "bucket": bucket.index, "bytes": bucket.nbytes}
    stream.rows[seq] = row
    trace.append(row)
    return row


def _stamp(row: dict[str, Any] | None, key: str) -> None:
    """Record ``time.monotonic()`` (seconds) as ``row[key]`` when tracing."""
    if row is not None:
        row[key] = time.monotonic()


def _exhaust(groups: Iterator[Any]) -> None:
    for _ in groups:
        raise RefitMismatchError("the source yielded more buckets than the plan holds")
