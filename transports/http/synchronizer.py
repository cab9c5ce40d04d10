"""``HTTPWeightSynchronizer``: colocated SGLang servers refit through their HTTP API.

The trainer streams its weights as single-dtype flattened buckets, one
``/update_weights_from_tensor`` per bucket and server, inside SGLang's weight-update
session (``/begin_weight_update`` ... ``/end_weight_update``, where the server has
it), then flushes the cache and sets the version label (``/update_weight_version``)
only once all of it landed. Before that label, ``verify`` reads tensors back through
SGLang's own ``/get_weights_by_name`` and compares them with what was sent (a
read-back of sampled tensors, not a per-bucket digest: SGLang checks none;
:mod:`._readback`). The steps, the memory lifetimes and the failure rules:
``docs/sglang.md``; SGLang's endpoints as read in its sources: ``docs/sglang-contract.md``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar, Unpack

import anyio
import torch

from aiosync._config import DEFAULT_BUCKET_BYTES
from aiosync._fanout import most_telling
from aiosync._kv_scales import attention_layers, kv_scale_entries
from aiosync.errors import SyncError, TransportError
from aiosync.options import TransportCapabilities
from aiosync.sources import RefitManifest, RefitSource
from aiosync.synchronizer import KVScales, SharedKeywords, Transferred, WeightSynchronizer

from .._options import check_positive
from .._verify import Verify, check_verify
from ..packing import compare_unordered
from ._checks import ServerChecks
from ._readback import (
    Expected,
    choose_reads,
    keep_samples,
    served_dtype,
)
from ._segment import SegmentPool
from ._servers import servers_of
from ._wire import (
    FLATTENED_BUCKET,
    FlatBucket,
    FlatBuffer,
    FlatSlot,
    allocate_flat,
    group_flat,
    pack_flat,
    plan_flat_buckets,
    serialize_flat,
)
from .server import (
    SGLangManifestSource,
    SGLangServer,
    SGLangWeightUpdateSession,
)

__all__ = ["HTTPWeightSynchronizer"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")


class HTTPWeightSynchronizer(ServerChecks):
    """Refits colocated SGLang servers over HTTP (``/update_weights_from_tensor``).

    Args:
        policy: the trainer's refit source (HF checkpoint names).
        generation: the server: anything that satisfies :class:`SGLangServer`,
            e.g. an :class:`aiosync.SGLangHTTPBackend` (URL, API key, memory
            saver, timeouts live there); or several, as an
            :class:`aiosync.EngineFleet` of them (what
            ``create_weight_synchronizer`` makes of a list) or a list.
        bucket_bytes: limit per flattened bucket, bytes; a larger tensor travels
            alone. On CPU two shared-memory segments of about this size (and one
            or two the size of a larger tensor) stay in ``/dev/shm`` from the
            first sync until :meth:`shutdown` or a failed post.
        device: where buckets are packed: ``"cpu"`` (named shared memory) or a
            CUDA device (CUDA-IPC handles); None: per bucket, the device of its
            first tensor.
        abort_all_requests: ask SGLang to abort running requests before the
            first bucket loads.
        timeouts: every limit (:class:`~aiosync.Timeouts`): ``sync_s`` for a whole
            sync, ``rpc_s`` for the KV-cache wake after it, ``after_failure_s`` for
            each clean-up step after a failure. Each request's own limit is the
            server object's (``SGLangHTTPBackend(request_timeout_s=...)``).
        **shared: ``sync_timeout_s``, ``event_backlog``, ``in_flight``,
            ``initial_version``, ``on_failure``
            (:class:`~aiosync.synchronizer.SharedKeywords`): as
            :class:`~aiosync.WeightSynchronizer`.
        trace: record per-bucket timestamps of every sync into
            :attr:`last_trace`; off by default.
        verify: check what each server holds after the last bucket loaded and
            before the version is labelled: a READ-BACK through SGLang's own
            ``/get_weights_by_name`` (a real SGLang server checks no digest a
            trainer sends, so there is no per-bucket digest here). ``"sample"``
            (default): the first rows (about 1024 elements) of the first and last
            tensor of every bucket, kept from the packed bucket (a few KiB each),
            of which at most 8 are read per server and sync (the first bucket's,
            the last one's, and others spread over the rest, shifted each version:
            a read is a round trip, so the cost stays fixed as the model grows);
            ``True``: every tensor whole, re-read from the source (one tensor at a
            time); ``False``: no check. A difference raises
            :class:`~aiosync.RefitVerificationError` naming the server, the tensor
            and its first differing element: the sync fails, the version is not
            labelled, the server refuses to generate until a sync succeeds. Not
            read back (SGLang's answer is not the checkpoint's tensor there): 0-d
            tensors, the KV-cache scales, and ``q_proj``/``k_proj``/``v_proj``
            unless the model's HF config (the trainer's or the server's) shows
            ``head_dim == hidden_size // num_attention_heads``; a tensor the server
            cannot read (SGLang's 400, no rows) and a server object without
            :class:`SGLangWeightReader` are logged once and not checked. With
            ``True`` every source tensor not compared is named, with why, in the
            ``COMMITTED`` event's ``unverified`` (and a warning): a commit never
            hides a tensor the check skipped (Qwen3: all q/k/v_proj).
        record_checksums: at each commit (after the flush, before the label) ask every
            server's ``/weights_checker`` (SGLang 0.5.23) for the checksum of each tensor
            of each TP rank, and keep them: :meth:`verify_engine` then also finds any
            server tensor changed since that commit, the fused ones included (one
            request per server and sync; the server hashes all its weights, on GPU a
            Triton pass over them). A server without the route (404) is warned about
            once and has no record. Off by default.

    Raises:
        TypeError: ``generation`` (or one of its engines) does not satisfy
            :class:`SGLangServer`; the message names what it lacks.
        ValueError: ``bucket_bytes`` is not positive, no server, the same
            server twice, or ``verify`` is not True, False or ``"sample"``.
    """

    #: What it can do, as data (:class:`~aiosync.TransportCapabilities`): the factory
    #: refuses a shared option outside it; the conformance kit runs its cells.
    capabilities = TransportCapabilities(
        verify=frozenset({False, "sample", True}),
        trace=True,
        elastic=True,
        verify_engine=True,
    )

    def __init__(
        self,
        policy: RefitSource,
        generation: SGLangServer | Sequence[SGLangServer] | Any,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: str | torch.device | None = None,
        abort_all_requests: bool = False,
        trace: bool = False,
        verify: Verify = "sample",
        record_checksums: bool = False,
        **shared: Unpack[SharedKeywords],
    ) -> None:
        servers = servers_of(generation)
        check_positive("bucket_bytes", bucket_bytes)
        verify = check_verify(verify)
        super().__init__(
            policy,
            generation,
            **shared,
        )
        self.bucket_bytes = bucket_bytes
        self.device = None if device is None else torch.device(device)
        self.abort_all_requests = abort_all_requests
        #: The read-back check of every sync (see the class docs); read at each sync.
        self.verify: Verify = verify
        #: Record every server's ``/weights_checker`` checksums at each commit (class docs).
        self.record_checksums = record_checksums
        # The checksums recorded at the last commit, {server URL: {(rank, name): hex}},
        # and that commit's version; emptied when a sync starts (the weights change).
        self._checksums: dict[str, dict[tuple[str, str], str]] = {}
        self._checksum_version = self.weight_version
        #: What the last :meth:`verify_engine` did not compare with the trainer's
        #: weights, as ``"name: why"`` (and, where recorded checksums covered it,
        #: since when it is known unchanged).
        self.live_unverified: tuple[str, ...] = ()
        self._plan: tuple[FlatBucket, ...] = ()
        self._tp_sizes = [1] * len(servers)
        # Per server (index of ``servers``), learnt at init: its DP ranks (each answers
        # a read-back) and the dtype it holds the weights in (None: unknown).
        self._dp_sizes = [1] * len(servers)
        self._served_dtypes: list[torch.dtype | None] = [None] * len(servers)
        # Whether SGLang reads q/k/v_proj back at the checkpoint's rows (_readback.py).
        self._read_qkv = False
        # What the read-back already warned about (server URL, reason): once each.
        self._warned: set[tuple[str, str]] = set()
        # CPU bucket segments kept between buckets and syncs (see _segment.py); sized
        # at init_communicator(), emptied whenever a post was not answered.
        self._pool = SegmentPool(bucket_bytes)
        #: Whether each sync records :attr:`last_trace` (off by default).
        self.trace = trace
        #: The timeline of the last sync made with :attr:`trace` on (None before):
        #: ``{"buckets": [row, ...], "phases": {name: t}}``, every time a
        #: ``time.monotonic()`` reading, seconds (``CLOCK_MONOTONIC`` on Linux: one
        #: clock for every process of the host, so a server's stamps compare). A
        #: row per bucket, in post order: ``seq`` (bucket index), ``bytes``,
        #: ``pack_start`` (the source asked for the bucket's first tensor),
        #: ``packed`` (its tensors read), ``pack_end`` (copied into the buffer),
        #: ``posted`` (the requests start) and ``answered`` (every server
        #: answered). ``phases``: ``start``, ``woken`` (weights resumed),
        #: ``verified`` (the read-back done, inside the weight-update session; not
        #: with ``verify=False``), ``streamed`` (last bucket answered and the session
        #: ended), ``flushed``, ``versioned``.
        self.last_trace: dict[str, Any] | None = None
        # The base class listens for discards from now on; weights discarded before
        # this synchronizer existed count too.
        if not all(server.weights_valid for server in servers):
            self._invalidate_engine_weights()

    @property
    def plan(self) -> tuple[FlatBucket, ...]:
        """The bucket plan (after :meth:`init_communicator`)."""
        return self._plan

    async def open(self, sync: WeightSynchronizer) -> None:
        """Plan the buckets; learn each server's TP size, check its settings, manifest and
        model config.

        When a server object offers ``expected_manifest()``
        (:class:`SGLangManifestSource`, e.g. ``SGLangHTTPBackend``), the
        trainer's names, shapes and dtypes are compared with it here, in any
        order (SGLang loads names in any order), before any bucket is posted.
        Every server is asked concurrently.

        Raises:
            TransportError, SyncTimeoutError: a server is unreachable or refuses.
            SyncError: ``enable_memory_saver`` differs from the server's.
            RefitMismatchError: the trainer's manifest differs from the server's
                (names the first differing entries on both sides), or its HF
                config does in a field that changes the computation (when the
                source knows its config and the server object reports one:
                ``SGLangHTTPBackend.expected_config``).
            With several servers the message names the server.
        """
        self._check_open()
        manifest = await self._read_manifest()
        # Shapes as plain int tuples (a source may give torch.Size or numpy ints):
        # the bucket plan and the server's manifest compare them exactly.
        self._manifest = {
            name: (tuple(int(d) for d in shape), dtype) for name, (shape, dtype) in manifest.items()
        }
        self._plan = plan_flat_buckets(self._manifest, self.bucket_bytes)
        # Every ordinary bucket fits every pooled segment; a tensor larger than
        # bucket_bytes gets a segment of its size, kept for it too.
        segment_bytes = max(
            (b.nbytes for b in self._plan if b.nbytes <= self.bucket_bytes), default=0
        )
        self._pool.clear()
        self._pool = SegmentPool(max(segment_bytes, 1))
        facts = await self._each(self._check_server)
        self._tp_sizes = [tp for tp, _, _ in facts]
        self._dp_sizes = [dp for _, dp, _ in facts]
        self._served_dtypes = [dtype for _, _, dtype in facts]
        # Same shapes, other computation (another rope_theta): refused before any bucket too.
        await self._check_model_configs()
        self._read_qkv = await self._qkv_read_back() if self.verify is not False else False

    async def _check_server(self, server: SGLangServer) -> tuple[int, int, torch.dtype | None]:
        """One server's part of :meth:`init_communicator`; returns its TP size, DP size
        and the dtype it holds its weights in (None: not known)."""
        info = await server.server_info()
        server_saver = info.get("enable_memory_saver")
        if server_saver is not None and bool(server_saver) != server.enable_memory_saver:
            raise SyncError(
                f"the SGLang server runs with enable_memory_saver={bool(server_saver)} but the "
                f"backend was built with enable_memory_saver={server.enable_memory_saver}"
            )
        if server.tp_size is None:
            tp = info.get("tp_size", 1)
            server.tp_size = tp if isinstance(tp, int) and tp >= 1 else 1
        if isinstance(server, SGLangManifestSource):
            engine = await server.expected_manifest(info)
            if engine is not None:
                compare_unordered(self._trainer_manifest, engine)
        dp = info.get("dp_size", 1)
        return server.tp_size, dp if isinstance(dp, int) and dp >= 1 else 1, served_dtype(info)

    @property
    def _trainer_manifest(self) -> RefitManifest:
        """The source's manifest read at :meth:`init_communicator` (empty before)."""
        return self._manifest or {}

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        """The fleet's engines changed: :meth:`open` again over the engines now in it."""
        await self.open(sync)

    async def send(
        self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None
    ) -> Transferred:
        kv = kv_scale_entries(kv_scales, attention_layers(self._trainer_manifest))
        rows: list[dict[str, Any]] | None = [] if self.trace else None
        phases: dict[str, float] = {"start": time.monotonic()}
        verify = self.verify
        # "sample": the sampled tensors' first rows, kept while packing (a few KiB per
        # bucket); True re-reads the source instead (never a copy of the model).
        kept: list[Expected] | None = [] if verify == "sample" else None
        unverified: tuple[str, ...] = ()
        self._checksums = {}
        async with self._refit_bracket():
            phases["woken"] = time.monotonic()
            async with self._weight_update_sessions():
                nbytes = await self._send_buckets(kv, rows, kept)
                if verify is not False:
                    # Inside the session: before /end_weight_update's post-processing,
                    # which may lay a quantized model's weights out otherwise.
                    unverified = await self._read_back(verify, choose_reads(kept or [], version))
                    phases["verified"] = time.monotonic()
            phases["streamed"] = time.monotonic()
            await self._each(lambda server: server.flush_cache())
            phases["flushed"] = time.monotonic()
            if self.record_checksums:
                # What the servers hold of this version as they will compute with it
                # (after the session's post-processing): verify_engine()'s reference.
                recorded = await self._each_indexed(self._server_checksums)
                self._checksums = {
                    server.base_url: sums
                    for server, sums in zip(self.servers, recorded, strict=True)
                    if sums is not None
                }
                self._checksum_version = version
            # Only now: the whole version landed and no KV of the old one survives.
            label = str(version)
            await self._each(
                lambda server: server.update_weight_version(label, abort_all_requests=False)
            )
            phases["versioned"] = time.monotonic()
            for server in self.servers:
                server.note_weights_loaded()
        if rows is not None:
            self.last_trace = {"buckets": rows, "phases": phases}
        return Transferred(nbytes, unverified=unverified)

    def _refit_bracket(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a sync's transfer: offload the trainer, wake the servers' weights;
        after it (also on failure or cancellation) the KV cache: SGLang's two-phase
        wake (:meth:`_colocated_refit`)."""
        return self._colocated_refit(self.servers)

    @contextlib.asynccontextmanager
    async def _weight_update_sessions(self) -> AsyncIterator[None]:
        """SGLang's weight-update session on every server that has one, around the block.

        ``/begin_weight_update`` on each server first (a server without the
        routes answers 404 once and is driven sessionless from then on,
        :class:`SGLangWeightUpdateSession`); after the block, also after a
        failure or cancellation, ``/end_weight_update`` on every server, side by
        side, one's failure not stopping the others', shielded and bounded by
        ``timeouts.rpc_s`` (``timeouts.after_failure_s`` after a failure): no
        server is left inside a session. An error of an end after a failure is
        logged, never raised over the block's; after a success it fails the sync
        (the loader's post-processing did not run).
        """
        sessions = [
            (index, server)
            for index, server in enumerate(self.servers)
            if isinstance(server, SGLangWeightUpdateSession)
        ]
        failed = True
        try:
            await self._each(
                lambda server: (
                    server.begin_weight_update()
                    if isinstance(server, SGLangWeightUpdateSession)
                    else _none()
                )
            )
            yield
            failed = False
        finally:
            limit = self.timeouts.after_failure_s if failed else self.timeouts.rpc_s
            errors: list[tuple[int, BaseException]] = []

            async def end(index: int, server: SGLangWeightUpdateSession) -> None:
                try:
                    with anyio.fail_after(limit):
                        await server.end_weight_update()
                except Exception as exc:
                    errors.append((index, exc))

            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for index, server in sessions:
                        tg.start_soon(end, index, server)
            for index, exc in sorted(errors, key=lambda e: e[0]):
                where = self._label(index)
                if failed:
                    _log.error("%s: /end_weight_update after a failed sync: %r", where, exc)
                else:
                    raise TransportError(
                        f"{where}: /end_weight_update failed, so the loader's post-processing "
                        f"may not have run: {exc}"
                    ) from exc

    async def _send_buckets(
        self,
        kv: Sequence[tuple[str, float]] = (),
        trace: list[dict[str, Any]] | None = None,
        kept: list[Expected] | None = None,
    ) -> int:
        """Stream every bucket to the servers, then the KV-scale bucket (if ``kv``);
        returns the payload bytes (of one server's copy). ``trace``: a list that
        gets one row per bucket (see :attr:`last_trace`); None records nothing.
        ``kept``: a list that gets ``verify="sample"``'s tensors of each bucket as
        packed (:func:`._readback.keep_samples`), taken in the packing thread.

        Two stages overlap: while the server loads bucket ``k`` the next one is
        gathered and packed. At most two buckets exist at a time (one in flight,
        one packed and waiting); each is released only after the server answered
        for it: a CPU one back into the segment pool, whose segments
        stay mapped for the next bucket and sync. When the stream ends any other
        way every buffer still held is released and the pool emptied, its
        segments unlinked: a server may still hold an unanswered
        payload, so none of its memory is ever written again.
        """
        send, receive = anyio.create_memory_object_stream[
            tuple[FlatBucket, FlatBuffer, dict[str, Any] | None]
        ](0)
        # Every buffer allocated and not yet released, whoever holds it now.
        live: set[FlatBuffer] = set()
        pool = self._pool

        def allocate(bucket: FlatBucket, device: torch.device) -> FlatBuffer:
            try:
                if device.type == "cpu":
                    flat = pool.take(bucket.numel, bucket.dtype)
                else:
                    flat = allocate_flat(bucket, device)
            except OSError as exc:
                raise TransportError(
                    f"bucket {bucket.index} ({bucket.nbytes} bytes): cannot create its "
                    f"shared-memory file: {exc}"
                ) from exc
            live.add(flat)
            return flat

        async def produce() -> None:
            device = self.device or torch.device("cpu")
            async with send:
                weights = self.policy.iter_weights()
                groups = group_flat(weights, self._plan, self._trainer_manifest)
                while True:
                    started = time.monotonic()
                    # The source gathers and casts (FSDP collectives, copies): in a worker
                    # thread, so the event loop keeps serving (generation, events) meanwhile.
                    item = await anyio.to_thread.run_sync(next, groups, None)
                    if item is None:
                        break
                    bucket, tensors = item
                    row = None if trace is None else _row(bucket, started)
                    device = self.device or tensors[0][1].device
                    flat = allocate(bucket, device)
                    await anyio.to_thread.run_sync(
                        _pack_and_keep, bucket, tensors, flat.tensor, row, kept, self._read_qkv
                    )
                    del tensors
                    try:
                        await send.send((bucket, flat, row))
                    except anyio.BrokenResourceError:
                        return  # the poster failed; its error is the one raised
                    del flat
                if kv:
                    bucket, tensors = _kv_bucket(len(self._plan), kv)
                    row = None if trace is None else _row(bucket, time.monotonic())
                    # Where the weights went (a CUDA-IPC handle on GPU, as they do).
                    flat = allocate(bucket, device)
                    _pack_and_wait(bucket, tensors, flat.tensor, row)  # a few bytes: inline
                    try:
                        await send.send((bucket, flat, row))
                    except anyio.BrokenResourceError:
                        return
                    del flat

        nbytes = 0
        answered = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                async with receive:
                    sent = 0
                    async for bucket, flat, row in receive:
                        sent += 1
                        if row is not None:
                            row["posted"] = time.monotonic()
                        await self._post_bucket(bucket, flat, sent)
                        # Every server answered: each loaded from its own mapping and
                        # dropped it, so the memory may take the next bucket.
                        live.discard(flat)
                        pool.recycle(flat)
                        if row is not None and trace is not None:
                            row["answered"] = time.monotonic()
                            trace.append(row)
                        nbytes += bucket.nbytes
            answered = True
        except BaseExceptionGroup as group:
            raise most_telling(group) from None
        finally:
            if not answered:
                # A post failed, timed out or was cancelled, or the source raised: a
                # server may still decode an unanswered payload later, so no segment
                # it may name is written again (unlinked; the next sync maps afresh).
                for flat in live:
                    flat.release()
                pool.clear()
        return nbytes

    async def _post_bucket(self, bucket: FlatBucket, flat: FlatBuffer, sent: int) -> None:
        if sent == 1:
            # From this post on the servers may hold a mix of two versions: invalid
            # (generate refuses) until send() notes the whole version loaded. Set
            # on every server before the first await, so that a failure, timeout or
            # cancellation leaves them all so.
            for server in self.servers:
                server.note_weights_loading()

        async def post(index: int, server: SGLangServer) -> None:
            # One serialization per TP rank (rank r loads entry r): SGLang refcounts
            # each CUDA-IPC handle per load. On CPU they name the same segment.
            payloads = [serialize_flat(bucket, flat) for _ in range(self._tp_sizes[index])]
            await server.update_weights_from_tensor(
                payloads,
                load_format=FLATTENED_BUCKET,
                flush_cache=False,
                abort_all_requests=self.abort_all_requests and sent == 1,
            )

        await self._each_indexed(post)

    async def close(self, sync: WeightSynchronizer) -> None:
        """End the event stream. Idempotent. The backend stays open: whoever
        built it closes it (``await backend.aclose()``), as the loop may still use it.
        Unlinks the pooled bucket segments."""
        self._pool.clear()

    def __repr__(self) -> str:
        urls = [server.base_url for server in self.servers]
        info: dict[str, Any] = {
            "url": urls[0] if len(urls) == 1 else urls,
            "buckets": len(self._plan),
            "weight_version": self.weight_version,
        }
        return f"HTTPWeightSynchronizer({info})"


async def _none() -> None:
    return None


def _kv_bucket(
    index: int, kv: Sequence[tuple[str, float]]
) -> tuple[FlatBucket, list[tuple[str, torch.Tensor]]]:
    """The KV-scale bucket: one float32 element per scale, each loaded as a 0-d tensor."""
    slots = tuple(FlatSlot(name, (), i, i + 1) for i, (name, _) in enumerate(kv))
    tensors = [(name, torch.tensor(value, dtype=torch.float32)) for name, value in kv]
    return FlatBucket(index, torch.float32, slots, len(kv)), tensors


def _pack_and_wait(
    bucket: FlatBucket,
    tensors: list[tuple[str, torch.Tensor]],
    flat: torch.Tensor,
    row: dict[str, Any] | None = None,
) -> None:
    """Pack on this (worker) thread; on CUDA, wait until the copies are done. ``row``:
    a trace row that gets ``packed`` (tensors read) and ``pack_end``."""
    if row is not None:
        row["packed"] = time.monotonic()
    pack_flat(bucket, tensors, flat)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    if row is not None:
        row["pack_end"] = time.monotonic()


def _pack_and_keep(
    bucket: FlatBucket,
    tensors: list[tuple[str, torch.Tensor]],
    flat: torch.Tensor,
    row: dict[str, Any] | None,
    kept: list[Expected] | None,
    qkv: bool,
) -> None:
    """:func:`_pack_and_wait`, then (``kept`` not None) ``verify="sample"``'s tensors of
    the bucket as packed, into ``kept`` (:func:`._readback.keep_samples`)."""
    _pack_and_wait(bucket, tensors, flat, row)
    if kept is not None:
        kept.extend(keep_samples(bucket, flat, qkv))


def _row(bucket: FlatBucket, started: float) -> dict[str, Any]:
    """A trace row for ``bucket`` whose first tensor was asked for at ``started``."""
    return {"seq": bucket.index, "bytes": bucket.nbytes, "pack_start": started}
