"""The IPC transport's sender: how one sync's buckets reach the workers.

:class:`_BucketSender` streams each lane's buckets: it picks the ping-pong buffer
(or a transient one) for each, has :class:`~._packer._Packer` pack the bucket into
it (or refer to its tensors where they lie, in direct mode), sends its ``data``
message over the trainer's ROUTER (:class:`~._router._Router`) to the workers of
the lane, waits for their acks before reusing a buffer, and ends the sync with
``end``; the inline path sends everything inside the receive's session. The
protocol is in :mod:`aiosync.transports.ipc.synchronizer`'s docstring; the
synchronizer owns the sync's bracket, and builds one sender per plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import anyio
import torch

from aiosync.errors import TransportError

from .._identity import CPU_LABEL
from .._ranks import drain
from .._verify import Verify
from ..packing import Bucket, BucketPlan, group_by_bucket
from ._packer import _Check, _DirectBucket, _exhaust, _Packer, _release, _stage, _stamp
from ._router import _Router
from ._shm import EMPTY_HANDLE, SharedBuffer

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The largest refit sent inside the receive's session (one worker, see
#: ``_BucketSender.inlines``), bytes: its copy ends well within the 1 s a failed
#: sync's invalidation waits for a receive still running.
_INLINE_MAX_BYTES = 16 * 1024 * 1024

#: The largest inline refit read and packed on the event loop itself, bytes: its copy
#: takes well under the thread hop it saves (~0.1 ms of a ~1 ms sync's cost here).
_ON_LOOP_MAX_BYTES = 1024 * 1024

#: What a sync in flight raises when ``shutdown()`` interrupts it.
_SHUT_DOWN_MID_SYNC = "the IPC synchronizer was shut down during the sync"


class _BucketSender(_Router):
    """The trainer's socket (:class:`~._router._Router`) and staging buffers; streams
    one plan's buckets per call.

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
        super().__init__(directory, timeout_s, device_id)
        self.plan = plan
        self.device = device
        self._buffers = buffers
        self._packer = _Packer(device)
        #: Whether a bucket of arena tensors goes direct (set per sync by the synchronizer).
        self.direct = False
        # Whether this sync's source reads and packing run on the event loop (_in_thread).
        self._on_loop = False
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
        peers = (
            dict.fromkeys(ranks, b"")
            if inline
            else await self._handshake(sync_id, ranks, self.plan.digest)
        )
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
                await self._in_thread(self._packer.read_and_pack, groups, None, None, last, row)
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
                        self._packer.read_direct,
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
                            self._packer.read_and_pack, groups, None, None, False, row
                        )
                    await self._wait_acks(sync_id, stream, previous)
                buffer = self._buffers[slot]
                stream.holder[slot] = seq
            try:
                if packed is None:
                    # One thread hop reads the source (unless read above), packs, digests,
                    # and after the last bucket checks that the source ended.
                    _, digest = await self._in_thread(
                        self._packer.read_and_pack, groups, group, buffer, last, row, bucket, check
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
            self._packer.read_direct, groups, buckets, _Check(verify, version), None, len(buckets)
        )
        return _Ahead(groups, run, group, group is None and len(run) == len(buckets))

    def destination(self, name: str) -> torch.Tensor | None:
        """Where a :class:`~aiosync.interfaces.GathersInto` source may gather tensor
        ``name`` (:meth:`._packer._Packer.destination`). Called in the packing thread,
        from inside the source."""
        return self._packer.destination(name)

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
        """Close the socket, unlink the buffers and remove the directory (idempotent)."""
        if self.closed:
            return
        super().close()
        buffers, self._buffers = self._buffers, []
        _release(self.directory, buffers)


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
