"""The two halves of one sync on the data group: the source's send loop and a receiver's.

Both follow the wire format of :mod:`aiosync.transports.collective._wire` and keep at
least two buckets in flight: the source packs bucket ``k+1`` while bucket ``k``
is on the wire, and a receiver posts the receive of bucket ``k+1`` before it
loads bucket ``k``. Each loop ends with the vote (:func:`agree_sync`), so
all ranks raise together or none does; the source's is :func:`vote_send`, apart
from :func:`stream_buckets`, so that the synchronizer can fold the other trainer
ranks' outcome in between.

With ``verify`` (``"sample"`` or ``True``, :mod:`aiosync.transports._verify`) the
source digests each bucket as it packs it and sends the digests in the trailer;
each receiver digests what it received and compares before its vote, so a
bucket that arrived otherwise than it was sent fails the sync on every rank
(:class:`~aiosync.errors.RefitVerificationError`) before any worker counts its
weights valid.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aiosync._digest import BlockDigest
from aiosync.errors import (
    RefitMismatchError,
    RefitVerificationError,
    SyncError,
    SyncTimeoutError,
    TransportError,
)

from .._verify import Verify, bucket_digest, sample_key, transit_fault
from ..packing import Bucket, BucketPlan, group_by_bucket, pack
from ._group import STATUS_ERROR, STATUS_MISMATCH, STATUS_OK, STATUS_TIMEOUT, SyncGroup
from ._wire import (
    decode_trailer,
    encode_trailer,
    header_tensor,
    trailer_nbytes,
    validate_header,
)

__all__ = [
    "STATUS_VERIFY",
    "RotatingBuffers",
    "SendResult",
    "Tracer",
    "WorkerNames",
    "agree_sync",
    "bucket_tensors",
    "receive_buckets",
    "send_buckets",
    "stream_buckets",
    "vote_send",
]


class RotatingBuffers:
    """``count`` reusable ``uint8`` buffers of the plan's regular bucket size.

    A bucket larger than ``plan.bucket_bytes`` (one oversized tensor, case C1)
    does not grow the regular buffers: it lands in an "oversized" buffer of
    its own, allocated on first use and kept (one per rotation slot), so a
    1.7 GB embedding costs its bytes once rather than page faults every sync.
    """

    def __init__(self, plan: BucketPlan, device: torch.device, count: int = 2) -> None:
        regular = [b.nbytes for b in plan.buckets if b.nbytes <= plan.bucket_bytes]
        size = max(regular, default=0)
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        self._oversized: dict[int, torch.Tensor] = {}
        self._oversized_bytes = plan.max_bucket_nbytes
        self._device = device

    def __call__(self, bucket: Bucket) -> torch.Tensor:
        slot = bucket.index % len(self._buffers)
        buf = self._buffers[slot]
        if bucket.nbytes > buf.numel():
            buf = self._oversized.get(slot, buf)
            if bucket.nbytes > buf.numel():
                buf = torch.empty(self._oversized_bytes, dtype=torch.uint8, device=self._device)
                self._oversized[slot] = buf
        return buf[: bucket.nbytes]

    def for_plan(self, plan: BucketPlan) -> RotatingBuffers | Callable[[Bucket], torch.Tensor]:
        """These buffers when they hold every bucket of ``plan`` (a per-sync plan, a
        delta's), else fresh ones for it."""
        if plan.max_bucket_nbytes <= max(self._oversized_bytes, self._buffers[0].numel()):
            return self
        return RotatingBuffers(plan, self._device, len(self._buffers))


def _zero_copy(
    bucket: Bucket, tensors: list[tuple[str, torch.Tensor]], device: torch.device
) -> torch.Tensor | None:
    """A one-tensor bucket whose tensor is contiguous on ``device`` is sent as is, unpacked."""
    if len(tensors) != 1:
        return None
    tensor = tensors[0][1].detach()
    if not tensor.is_contiguous() or tensor.device != device:
        return None
    raw = tensor.reshape(-1).view(torch.uint8)
    return raw if raw.numel() == bucket.nbytes else None


#: ``trace(event, bucket_index)``: a per-bucket timestamp hook of the loops
#: (``benchmarks/collective.py --trace``); it reads the clock itself.
Tracer = Callable[[str, int], None]


def _no_trace(event: str, index: int) -> None:
    """The default tracer: records nothing."""


#: The vote of a receiver that received a bucket otherwise than the source sent it.
STATUS_VERIFY = 4

#: ``names(worker)``: how a message names inference worker ``worker`` (0-based, the
#: engine's global worker rank), e.g. ``"engine 0 of 2 (EmbeddedEngine): engine worker 1"``.
WorkerNames = Callable[[int], str]


def _engine_worker(worker: int) -> str:
    return f"engine worker {worker}"


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, RefitMismatchError):
        return STATUS_MISMATCH
    if isinstance(exc, RefitVerificationError):
        return STATUS_VERIFY
    return STATUS_ERROR


def agree_sync(
    group: SyncGroup, status: int, message: str = "", *, names: WorkerNames | None = None
) -> None:
    """A sync's vote (:meth:`SyncGroup.exchange`): raise the same error on every rank
    if any rank failed (blocking).

    A receiver's :data:`STATUS_VERIFY` message is named after the worker
    (``names``; default ``"engine worker <rank>"``), the others after their
    session rank, as :meth:`SyncGroup.agree` does.

    Raises:
        RefitMismatchError: a rank could not accept the weights.
        RefitVerificationError: a receiver's bucket digests differ from the source's.
        SyncTimeoutError: every failing rank reported a timeout.
        TransportError: a rank reported another failure.
    """
    votes = group.exchange(status, message)
    name = names or _engine_worker
    problems: list[str] = []
    codes: set[int] = set()
    for rank, (code, _, text) in enumerate(votes):
        if code == STATUS_OK:
            continue
        codes.add(code)
        if code == STATUS_VERIFY and rank >= group.train_world_size:
            problems.append(f"{name(rank - group.train_world_size)}: {text}")
        else:
            problems.append(f"{group.describe_rank(rank)}: {text}")
    if not problems:
        return
    text = "; ".join(problems)
    if STATUS_MISMATCH in codes:
        raise RefitMismatchError(text)
    if STATUS_VERIFY in codes:
        raise RefitVerificationError(text)
    if codes == {STATUS_TIMEOUT}:
        raise SyncTimeoutError(text)
    raise TransportError(text)


def bucket_tensors(bucket: Bucket) -> str:
    """``"'first.name' and 4 more"``: a bucket's tensors, for messages."""
    if not bucket.slots:
        return "no tensors"
    first = repr(bucket.slots[0].name)
    more = len(bucket.slots) - 1
    return f"{first} and {more} more" if more else first


def _digest(buf: torch.Tensor, bucket: Bucket, verify: Verify, version: int) -> int:
    """The digest of ``bucket`` in the sync of ``version`` (``uint8`` bytes ``buf``)."""
    return bucket_digest(
        buf,
        verify,
        key=sample_key(version, bucket.index),
        slots=[(s.offset, s.nbytes) for s in bucket.slots],
    )


@dataclass(frozen=True, slots=True)
class SendResult:
    """What the source sent: payload bytes and, unless verify is off, the per-bucket
    digests (signed int64 each, bucket order)."""

    nbytes: int
    checksums: list[int]


def _cuda_stream(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def send_buckets(
    group: SyncGroup,
    *args: Any,
    names: WorkerNames | None = None,
    **stream: Any,
) -> SendResult:
    """Source side: :func:`stream_buckets` (its arguments after ``group``: ``plan``,
    ``buffers``, ``weights`` and its keywords) then :func:`vote_send` (``names``;
    blocking).

    Raises:
        RefitMismatchError: the weights differ from the plan (on every rank).
        RefitVerificationError: a receiver's bucket arrived otherwise than sent.
        TransportError, SyncTimeoutError: a collective failed (group broken).
    """
    sent, failure = stream_buckets(group, *args, **stream)
    vote_send(group, failure, names=names)
    return sent


def vote_send(
    group: SyncGroup, failure: BaseException | None, *, names: WorkerNames | None = None
) -> None:
    """The source's vote with the receivers after :func:`stream_buckets` (blocking).

    ``names`` names a worker whose check of what it received failed (default
    ``"engine worker <rank>"``).

    Raises:
        The agreed error of :func:`agree_sync` when any rank failed
        (``failure`` itself if the vote was lost).
    """
    if failure is not None:
        agree_sync(group, _status_of(failure), f"source failed: {failure}", names=names)
        raise failure  # agree_sync() raised already unless the vote was lost
    agree_sync(group, STATUS_OK, names=names)


def stream_buckets(
    group: SyncGroup,
    plan: BucketPlan,
    buffers: RotatingBuffers,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    kv: list[tuple[str, float]],
    verify: Verify,
    cancelled: Callable[[], bool] = lambda: False,
    trace: Tracer | None = None,
) -> tuple[SendResult, BaseException | None]:
    """Source side up to the vote: header, packed buckets, trailer (blocking).

    ``trace(event, bucket_index)``, when given, is called as bucket ``k``'s
    tensors are in hand (``"gathered"``), packed (``"packed"``), right before
    its broadcast is posted (``"broadcasting"``: no receiver can have it
    earlier) and seen complete (``"sent"``; observed when its buffer is next
    needed, or at the end).

    ``weights`` is consumed lazily, so producing (gathering) bucket ``k+1``
    overlaps the broadcast of bucket ``k``. On CUDA packing runs on a side
    stream that the broadcast waits for. If the source fails half-way (the
    stream differs from the plan) it still sends the remaining buckets, so no
    receiver is left blocked, and returns that failure for the vote. Unless
    ``verify`` is False each bucket is digested right after it is packed (on
    the side stream) and the digests travel in the trailer.

    Returns:
        ``(what was sent, the source's read failure or None)``.

    Raises:
        TransportError, SyncTimeoutError: a collective failed (group broken).
    """
    mark = trace or _no_trace
    header = header_tensor(version, plan, len(kv), verify).to(group.device)
    group.wait(group.broadcast(header, what="broadcast of the sync header"), what="header")
    stream = _cuda_stream(group.device)
    # On CUDA every use of a bucket buffer (wait for its previous broadcast,
    # pack, digest, broadcast) is ordered on one side stream; the tensors come
    # from the caller's stream, which the side stream waits for before packing.
    main = torch.cuda.current_stream(group.device) if stream is not None else None

    def on_side() -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    pending: dict[int, tuple[Any, torch.Tensor, int]] = {}
    checksums: list[int] = []
    failure: BaseException | None = None
    groups: Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]]]] = group_by_bucket(weights, plan)
    for bucket in plan.buckets:
        if cancelled():
            group.broken = True  # receivers wait for buckets that will not come
            raise TransportError("sync cancelled")
        slot = bucket.index % 2
        if slot in pending:
            with on_side():
                group.wait(pending.pop(slot)[0], what=f"broadcast of bucket {bucket.index - 2}")
            mark("sent", bucket.index - 2)
        buf: torch.Tensor | None = None
        # verify=True: the bucket is digested as it is packed (each chunk in cache).
        blocks: BlockDigest | None = None
        if failure is None:
            try:
                _, tensors = next(groups)  # gathers run on the caller's stream
                mark("gathered", bucket.index)
                with on_side():
                    if stream is not None and main is not None:
                        stream.wait_stream(main)
                        for _, t in tensors:
                            t.record_stream(stream)
                    buf = _zero_copy(bucket, tensors, group.device)
                    if buf is None:
                        buf = buffers(bucket)
                        blocks = BlockDigest() if verify is True else None
                        pack(bucket, tensors, out=buf, digest=blocks)
                mark("packed", bucket.index)
            except SyncError as exc:
                failure = exc
            except Exception as exc:
                failure = TransportError(f"source failed at bucket {bucket.index}: {exc!r}")
        with on_side():
            if buf is None:
                buf = buffers(bucket)  # after a failure: keep the receivers' loop going
            if verify is not False:
                if blocks is not None and failure is None:
                    checksums.append(blocks.value())
                else:  # "sample", a zero-copy bucket, or after a failed pack
                    checksums.append(_digest(buf, bucket, verify, version))
            mark("broadcasting", bucket.index)
            work = group.broadcast(buf, what=f"broadcast of bucket {bucket.index}")
        pending[slot] = (work, buf, bucket.index)  # keeps a zero-copy source alive until sent
    with on_side():
        for slot in sorted(pending, key=lambda k: pending[k][2]):
            group.wait(pending[slot][0], what="last bucket broadcasts")
            mark("sent", pending[slot][2])
    if stream is not None:
        stream.synchronize()  # the next sync reuses the buffers from another stream
    if failure is None and plan.buckets:
        # group_by_bucket raises on an extra tensor only when asked for more.
        try:
            next(groups)
        except StopIteration:
            pass
        except SyncError as exc:
            failure = exc
    if trailer_nbytes(len(kv), len(plan.buckets), verify):
        trailer = encode_trailer([v for _, v in kv], checksums).to(group.device)
        group.wait(group.broadcast(trailer, what="broadcast of the trailer"), what="trailer")
    return SendResult(plan.total_bytes + 4 * len(kv), checksums), failure


def receive_buckets(
    group: SyncGroup,
    plan: BucketPlan,
    buffer_for: Callable[[Bucket], torch.Tensor],
    *,
    version: int,
    n_kv: int,
    verify: Verify,
    on_bucket: Callable[[Bucket, torch.Tensor], None] | None,
    trace: Tracer | None = None,
    refuse: BaseException | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Receiver side: header, buckets, trailer, checks, vote (blocking).

    ``trace(event, bucket_index)``, when given, is called as bucket ``k``'s
    receive is posted (``"posted"``), has landed (``"received"``) and was
    handed to ``on_bucket`` (``"loaded"``).

    ``on_bucket(bucket, buffer)`` (in-place mode: load the weights) runs while
    the next bucket is in flight; if it raises, the loop keeps receiving (so
    the source is not left blocked), stops loading, and votes the failure.
    ``refuse``, when given, is such a failure from the start: nothing is loaded.

    Each bucket goes through :func:`~aiosync.transports._verify.transit_fault`
    as it lands (a test's fault, else nothing), then ``on_bucket``; unless
    ``verify`` is False it is then digested (the bytes the weights were loaded
    from: the buffer is not reused before the receive after the next) and, once
    the trailer is in, compared with the source's digests before the vote; a
    mismatch is what this rank votes even when ``on_bucket`` failed too.

    Returns:
        ``(float32[n_kv] kv scales, this rank's per-bucket digests)``.

    Raises:
        RefitVerificationError: a bucket's digest differs from the source's, on
            this rank or another (every rank; names the worker, the bucket and
            its first tensor).
        TransportError: bad header, or a rank's failure (every rank).
        RefitMismatchError: a rank could not accept the weights (every rank).
        SyncTimeoutError: a collective ran past the group's timeout.
    """
    header = torch.zeros(5 + len(plan.buckets), dtype=torch.int64, device=group.device)
    group.wait(group.broadcast(header, what="receive of the sync header"), what="header")
    try:
        validate_header(header, version, plan, n_kv, verify)
    except TransportError:
        group.broken = True  # the rest of the stream cannot be interpreted
        raise
    mark = trace or _no_trace
    failure: BaseException | None = refuse
    local: list[int] = []
    pending: Any = None
    buffers = [buffer_for(b) for b in plan.buckets[:1]]
    if plan.buckets:
        pending = group.broadcast(buffers[0], what="receive of bucket 0")
        mark("posted", 0)
    for bucket in plan.buckets:
        buf = buffers[-1]
        group.wait(pending, what=f"receive of bucket {bucket.index}")
        mark("received", bucket.index)
        transit_fault(buf, bucket.index)  # a test's corruption, before anything reads it
        if bucket.index + 1 < len(plan.buckets):
            nxt = buffer_for(plan.buckets[bucket.index + 1])
            buffers = [buf, nxt]
            pending = group.broadcast(nxt, what=f"receive of bucket {bucket.index + 1}")
            mark("posted", bucket.index + 1)
        if on_bucket is not None and failure is None:
            try:
                on_bucket(bucket, buf)
            except Exception as exc:
                failure = exc
            mark("loaded", bucket.index)
        if verify is not False:
            # After the load: the digest covers the bytes the weights were copied from.
            local.append(_digest(buf, bucket, verify, version))
    kv = torch.empty(0, dtype=torch.float32)
    remote: list[int] = []
    size = trailer_nbytes(n_kv, len(plan.buckets), verify)
    if size:
        trailer = torch.zeros(size, dtype=torch.uint8, device=group.device)
        group.wait(group.broadcast(trailer, what="receive of the trailer"), what="trailer")
        kv, remote = decode_trailer(trailer, n_kv, 0 if verify is False else len(plan.buckets))
    if verify is not False and local != remote:
        bad = next(i for i, (a, b) in enumerate(zip(local, remote, strict=True)) if a != b)
        # The cause even when loading failed too: corrupt bytes (a delta's indices)
        # may be what made the load fail.
        failure = RefitVerificationError(
            f"bucket {bad} ({bucket_tensors(plan.buckets[bad])}) arrived with digest "
            f"{local[bad]}, the trainer sent {remote[bad]} (verify={verify!r})"
        )
    if failure is not None:
        # A verification failure's message is the worker's finding; the vote names it.
        message = (
            str(failure)
            if isinstance(failure, RefitVerificationError)
            else f"{type(failure).__name__}: {failure}"
        )
        agree_sync(group, _status_of(failure), message)
        raise failure
    agree_sync(group, STATUS_OK)
    return kv, local
