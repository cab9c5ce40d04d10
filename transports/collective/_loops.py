"""The two halves of one sync on the data group: the source's send loop and a receiver's.

Both follow the wire format of :mod:`aiosync.transports.collective._wire` and keep at
least two buckets in flight: the source packs bucket ``k+1`` while bucket ``k``
is on the wire, and a receiver posts the receive of bucket ``k+1`` before it
loads bucket ``k``. Each loop ends with the vote (:meth:`SyncGroup.agree`), so
all ranks raise together or none does; the source's is :func:`vote_send`, apart
from :func:`stream_buckets`, so that the synchronizer can fold the other trainer
ranks' outcome in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aiosync.errors import RefitMismatchError, SyncError, TransportError

from ..packing import Bucket, BucketPlan, bucket_checksum, group_by_bucket, pack
from ._group import STATUS_ERROR, STATUS_MISMATCH, STATUS_OK, SyncGroup
from ._wire import (
    decode_trailer,
    encode_trailer,
    header_tensor,
    trailer_nbytes,
    validate_header,
)

__all__ = [
    "RotatingBuffers",
    "SendResult",
    "Tracer",
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


def _status_of(exc: BaseException) -> int:
    return STATUS_MISMATCH if isinstance(exc, RefitMismatchError) else STATUS_ERROR


@dataclass(frozen=True, slots=True)
class SendResult:
    """What the source sent: payload bytes and, with verify, per-bucket checksums."""

    nbytes: int
    checksums: list[int]


def _cuda_stream(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def send_buckets(
    group: SyncGroup,
    plan: BucketPlan,
    buffers: RotatingBuffers,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    kv: list[tuple[str, float]],
    verify: bool,
    cancelled: Callable[[], bool] = lambda: False,
    trace: Tracer | None = None,
) -> SendResult:
    """Source side: :func:`stream_buckets` then :func:`vote_send` (blocking).

    Raises:
        RefitMismatchError: the weights differ from the plan (on every rank).
        TransportError, SyncTimeoutError: a collective failed (group broken).
    """
    sent, failure = stream_buckets(
        group,
        plan,
        buffers,
        weights,
        version=version,
        kv=kv,
        verify=verify,
        cancelled=cancelled,
        trace=trace,
    )
    vote_send(group, failure)
    return sent


def vote_send(group: SyncGroup, failure: BaseException | None) -> None:
    """The source's vote with the receivers after :func:`stream_buckets` (blocking).

    Raises:
        The agreed error of :meth:`SyncGroup.agree` when any rank failed
        (``failure`` itself if the vote was lost).
    """
    if failure is not None:
        group.agree(_status_of(failure), f"source failed: {failure}")
        raise failure  # agree() raised already unless the vote was lost
    group.agree(STATUS_OK)


def stream_buckets(
    group: SyncGroup,
    plan: BucketPlan,
    buffers: RotatingBuffers,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    kv: list[tuple[str, float]],
    verify: bool,
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
    receiver is left blocked, and returns that failure for the vote.

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
    # pack, checksum, broadcast) is ordered on one side stream; the tensors come
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
                        pack(bucket, tensors, out=buf)
                mark("packed", bucket.index)
            except SyncError as exc:
                failure = exc
            except Exception as exc:
                failure = TransportError(f"source failed at bucket {bucket.index}: {exc!r}")
        with on_side():
            if buf is None:
                buf = buffers(bucket)  # after a failure: keep the receivers' loop going
            if verify:
                checksums.append(bucket_checksum(buf))
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
    verify: bool,
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

    Returns:
        ``(float32[n_kv] kv scales, this rank's per-bucket checksums)``.

    Raises:
        TransportError: bad header, checksum mismatch, or a rank's failure (every rank).
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
        if verify:
            local.append(bucket_checksum(buf))
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
    kv = torch.empty(0, dtype=torch.float32)
    remote: list[int] = []
    size = trailer_nbytes(n_kv, len(plan.buckets), verify)
    if size:
        trailer = torch.zeros(size, dtype=torch.uint8, device=group.device)
        group.wait(group.broadcast(trailer, what="receive of the trailer"), what="trailer")
        kv, remote = decode_trailer(trailer, n_kv, len(plan.buckets) if verify else 0)
    if failure is None and verify and local != remote:
        bad = next(i for i, (a, b) in enumerate(zip(local, remote, strict=True)) if a != b)
        failure = TransportError(
            f"checksum mismatch in bucket {bad}: received data differs from what the source sent"
        )
    if failure is not None:
        group.agree(_status_of(failure), f"{type(failure).__name__}: {failure}")
        raise failure
    group.agree(STATUS_OK)
    return kv, local
