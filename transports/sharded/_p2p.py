"""The point-to-point executor of a :class:`~._plan.Plan`: every sender sends at once.

Group ranks ``0..T-1`` are the senders (trainer ranks), ``T..T+W-1`` the receivers
(inference workers). Between every sender and every receiver, in this order::

    handshake  int64[9] both ways   magic, src, dst, buckets, payload bytes, plan digest
    bucket k   uint8[nbytes_k]      sender -> receiver, k = 0 .. n-1 (the pair's buckets)
    finish     int64[4] both ways   magic, status, payload bytes, 0

Both ends compare the handshake with what their own plan says, so a pair whose
plans differ raises :class:`~aiosync.errors.RefitMismatchError` on both ends
before any bucket moves. The finish tells each end whether the other failed (a
sender whose ``source`` raised still sends its remaining buckets, so no receiver
waits for bytes that never come; a receiver whose ``sink`` raised keeps
draining), and it is what makes a sender notice a receiver that died after its
last bucket. Sizes and order come from the plan on both ends: nothing else is
on the wire.

The buckets travel in *steps*: step ``k`` is bucket ``k`` of every pair that has
one. A sender posts all of its step-``k`` sends as one ``batch_isend_irecv``
(one grouped call on NCCL), a receiver all of its step-``k`` receives, so every
rank's queue of operations is ordered by step and no send waits behind another
receiver's. Each pair keeps two buckets in flight: a sender packs step ``k+1``
while step ``k`` is on the wire (first waiting for step ``k-1``'s sends, whose
buffers it reuses), and a receiver posts step ``k+1``'s receives before it
hands step ``k`` to its sink. gloo's send completes only once the matching
receive is posted; each side's wait for step ``k`` depends only on the other
side's posts of steps ``<= k``, so the schedule cannot deadlock.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError

from ..collective._sync_group import translate_error
from ..packing import dtype_from_name
from ._plan import Box, Plan, TransferBucket, box_shape, box_within

__all__ = [
    "LINK_FAILURES",
    "LinkLost",
    "LinkTimeout",
    "P2PResult",
    "SinkFn",
    "SourceFn",
    "run_plan",
]

#: ``source(hf_name)`` on a sender: its local tensor of that name, shape
#: ``plan.sources[rank][hf_name].local_shape``, in the manifest dtype.
SourceFn = Callable[[str], torch.Tensor]

#: ``sink(hf_name, box, tensor)`` on a receiver: store one received box. ``tensor``
#: (shape ``box_shape(box)``, the manifest dtype) is a view into a receive buffer,
#: valid only during the call: copy it (``local[box_within(box, part)].copy_(tensor)``).
SinkFn = Callable[[str, Box, torch.Tensor], None]

_MAGIC = 0x6169_6F73_7032_7001  # "aiosp2p" + wire format 1
_OK, _MISMATCH, _ERROR = 0, 1, 2


@dataclass(frozen=True, slots=True)
class P2PResult:
    """What one rank moved in :func:`run_plan`.

    Attributes:
        role: ``"sender"`` or ``"receiver"``.
        nbytes: payload bytes this rank sent or received (no padding).
        by_peer: payload bytes per peer: receiver index → bytes on a sender,
            sender index → bytes on a receiver (every peer listed, 0 included).
        buckets: buckets this rank sent or received.
    """

    role: Literal["sender", "receiver"]
    nbytes: int
    by_peer: dict[int, int]
    buckets: int


class LinkLost(TransportError):
    """A point-to-point op failed: a peer died or closed the group."""


class LinkTimeout(SyncTimeoutError):
    """A point-to-point wait ran past its timeout: a peer stalled or is gone."""


#: The errors that mean a link, not a peer's own reported failure: the other ranks
#: may still wait for bytes that never come (abort the group rather than vote).
LINK_FAILURES: tuple[type[SyncError], ...] = (LinkLost, LinkTimeout)


def _translate(exc: BaseException, what: str) -> SyncError:
    """A torch / gloo / NCCL error as a link's (:class:`LinkTimeout`, :class:`LinkLost`)."""
    return translate_error(exc, what, timed_out=LinkTimeout, failed=LinkLost)


class _Link:
    """Posts and waits point-to-point ops on the group, every error translated.

    A process group registered with ``torch.distributed`` (``init_process_group``,
    ``new_group``) goes through ``batch_isend_irecv`` (NCCL then coalesces one
    batch into one group call). A bare backend object (``ProcessGroupGloo(store,
    rank, size)``, as the collective transport builds its groups) is not
    registered, which ``P2POp`` requires; its ``send``/``recv`` are posted
    directly, which is what ``batch_isend_irecv`` itself does on gloo.
    """

    def __init__(self, group: Any, timeout_s: float, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._registered = isinstance(group, dist.ProcessGroup)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except SyncError:
            raise
        except Exception as exc:
            raise _translate(exc, what) from exc

    def post(self, ops: Sequence[tuple[str, torch.Tensor, int]], what: str) -> list[Any | None]:
        """Post ``(kind, tensor, peer)`` ops (``kind`` ``"send"``/``"recv"``) as one batch.

        Returns one handle per op, in order. NCCL coalesces a batch into one
        handle for all of its ops: the first op gets it and the others None
        (waiting for the first covers them).
        """
        if not ops:
            return []
        with self.guard(what):
            if self._registered:
                p2p = [
                    dist.P2POp(
                        dist.isend if kind == "send" else dist.irecv,
                        tensor,
                        group=self.group,
                        group_peer=peer,
                    )
                    for kind, tensor, peer in ops
                ]
                works: list[Any] = list(dist.batch_isend_irecv(p2p))
            else:
                works = [
                    self.group.send([t], peer, 0)
                    if kind == "send"
                    else self.group.recv([t], peer, 0)
                    for kind, t, peer in ops
                ]
        if len(works) == len(ops):
            return works
        return [_AllOf(works), *([None] * (len(ops) - 1))]

    def wait(self, work: Any | None, what: str) -> None:
        """Wait for one handle from :meth:`post` (None: covered), at most the timeout."""
        if work is None:
            return
        with self.guard(what):
            work.wait(self.timeout)


class _AllOf:
    """The handles of one coalesced batch, waited as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> None:
        for work in self.works:
            work.wait(timeout)


def _packing_failure(exc: Exception, me: int, senders: int, step: int, worker: int) -> SyncError:
    """What a sender reports when packing bucket ``step`` for inference ``worker`` raised
    ``exc``: an aiosync error as it is, any other wrapped in a TransportError naming both."""
    if isinstance(exc, SyncError):
        return exc
    return TransportError(
        f"{_describe(me, senders)} failed packing bucket {step} for "
        f"inference worker {worker}: {exc!r}"
    )


def _describe(rank: int, senders: int) -> str:
    return f"trainer rank {rank}" if rank < senders else f"inference worker {rank - senders}"


def _handshake_tensor(
    plan: Plan, src: int, dst: int, device: torch.device, magic: int = _MAGIC
) -> torch.Tensor:
    buckets = plan.buckets_between(src, dst)
    digest = torch.frombuffer(bytearray(bytes.fromhex(plan.digest)), dtype=torch.int64)
    head = torch.tensor([magic, src, dst, len(buckets), plan.pair_bytes(src, dst)])
    return torch.cat([head, digest]).to(device)


def _handshake(link: _Link, plan: Plan, me: int, peers: Sequence[int], magic: int = _MAGIC) -> None:
    """Exchange the pair headers with every peer; both ends of a differing pair raise.

    ``magic`` names the wire format (a full plan's, or a delta's: :mod:`._delta`), so
    that two ends that would speak different ones refuse at once.

    Raises:
        RefitMismatchError: a peer's plan differs for this pair (digest, counts).
        TransportError, SyncTimeoutError: a peer is gone or too slow.
    """
    senders = plan.num_senders
    mine: dict[int, torch.Tensor] = {}
    theirs: dict[int, torch.Tensor] = {}
    ops: list[tuple[str, torch.Tensor, int]] = []
    for peer in peers:
        src, dst = (me, peer - senders) if me < senders else (peer, me - senders)
        mine[peer] = _handshake_tensor(plan, src, dst, link.device, magic)
        theirs[peer] = torch.zeros_like(mine[peer])
        ops += [("send", mine[peer], peer), ("recv", theirs[peer], peer)]
    works = link.post(ops, "posting the handshake")
    for work, (kind, _, peer) in zip(works, ops, strict=True):
        link.wait(work, f"handshake {kind} with {_describe(peer, senders)}")
    for peer in peers:
        if not torch.equal(mine[peer].cpu(), theirs[peer].cpu()):
            got = theirs[peer].cpu().tolist()
            want = mine[peer].cpu().tolist()
            raise RefitMismatchError(
                f"{_describe(me, senders)} and {_describe(peer, senders)} planned differently: "
                f"peer sent [magic, src, dst, buckets, bytes] {got[:5]} digest "
                f"{theirs[peer].cpu()[5:].numpy().tobytes().hex()[:16]}, expected {want[:5]} "
                f"digest {plan.digest[:16]}"
            )


def _finish(
    link: _Link, plan: Plan, me: int, peers: Sequence[int], status: int, nbytes: dict[int, int]
) -> dict[int, tuple[int, int]]:
    """Exchange each pair's outcome; returns ``{peer: (status, payload bytes)}``.

    Raises:
        TransportError, SyncTimeoutError: a peer is gone or too slow; a reply
            without the magic (a protocol mismatch).
    """
    senders = plan.num_senders
    outs = {p: torch.tensor([_MAGIC, status, nbytes[p], 0]).to(link.device) for p in peers}
    ins = {p: torch.zeros(4, dtype=torch.int64, device=link.device) for p in peers}
    ops = [(kind, t[p], p) for p in peers for kind, t in (("send", outs), ("recv", ins))]
    works = link.post(ops, "posting the finish")
    for work, (kind, _, peer) in zip(works, ops, strict=True):
        link.wait(work, f"finish {kind} with {_describe(peer, senders)}")
    result: dict[int, tuple[int, int]] = {}
    for peer in peers:
        magic, code, count, _ = ins[peer].cpu().tolist()
        if magic != _MAGIC:
            raise TransportError(f"bad finish message from {_describe(peer, senders)}")
        result[peer] = (code, count)
    return result


class _Sender:
    """One sender's side of :func:`run_plan` (see the module docstring)."""

    def __init__(self, link: _Link, plan: Plan, me: int, source: SourceFn) -> None:
        self.link = link
        self.plan = plan
        self.me = me
        self.source = source
        self.layout = plan.sources[me]
        # Each name's remaining transfers on this sender: a local tensor is read
        # once and dropped after its last box is packed (a cast copy lives briefly).
        self.uses: Counter[str] = Counter(
            t.name
            for w in range(plan.num_receivers)
            for b in plan.buckets_between(me, w)
            for t in b.transfers
        )
        self.cache: dict[str, torch.Tensor] = {}
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}

    def _local(self, name: str, dtype: str) -> torch.Tensor:
        if name not in self.cache:
            tensor = self.source(name)
            part = self.layout[name]
            want = dtype_from_name(dtype)
            if tuple(tensor.shape) != part.local_shape or tensor.dtype != want:
                raise RefitMismatchError(
                    f"{name}: {_describe(self.me, self.plan.num_senders)} gave "
                    f"{tuple(tensor.shape)} {tensor.dtype}, its part needs "
                    f"{part.local_shape} {want}"
                )
            self.cache[name] = tensor.detach()
        tensor = self.cache[name]
        self.uses[name] -= 1
        if self.uses[name] <= 0:
            del self.cache[name]
        return tensor

    def _buffer(self, dst: int, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers.get((dst, slot))
        if buf is None:
            size = max(b.nbytes for b in self.plan.buckets_between(self.me, dst))
            buf = torch.empty(size, dtype=torch.uint8, device=self.link.device)
            self.buffers[(dst, slot)] = buf
        return buf[:nbytes]

    def _pack(self, bucket: TransferBucket, slot: int) -> torch.Tensor:
        """The bucket's bytes: a zero-copy view of a lone contiguous box, else a packed buffer."""
        views = []
        for t in bucket.transfers:
            local = self._local(t.name, t.dtype)
            views.append((t, local[box_within(t.box, self.layout[t.name])]))
        if len(views) == 1:
            view = views[0][1]
            if view.is_contiguous() and view.device == self.link.device:
                raw = view.reshape(-1).view(torch.uint8)
                if raw.numel() == bucket.nbytes:
                    return raw
        buf = self._buffer(bucket.dst, slot, bucket.nbytes)
        for t, view in views:
            dst = buf[t.offset : t.offset + t.nbytes].view(view.dtype).view(box_shape(t.box))
            dst.copy_(view)
        return buf

    def run(self) -> P2PResult:
        plan, me, senders = self.plan, self.me, self.plan.num_senders
        receivers = plan.num_receivers
        # Sender i starts at receiver i (mod W): the first buckets spread over the receivers.
        order = [(me + k) % receivers for k in range(receivers)]
        peers = [senders + w for w in order]
        _handshake(self.link, plan, me, peers)
        lists = {w: plan.buckets_between(me, w) for w in order}
        steps = max((len(b) for b in lists.values()), default=0)
        # Per step slot: the handles of that step's sends, and the buffers they read.
        pending: dict[int, list[tuple[int, Any | None, torch.Tensor]]] = {}
        sent = dict.fromkeys(range(receivers), 0)
        failure: SyncError | None = None
        count = 0
        for step in range(steps):
            slot = step % 2
            # The buffers of step k-2 are reused now: its sends must be done.
            for w, work, _ in pending.pop(slot, []):
                self.link.wait(work, f"send of bucket {step - 2} to inference worker {w}")
            ops: list[tuple[str, torch.Tensor, int]] = []
            for w in order:
                if step >= len(lists[w]):
                    continue
                bucket = lists[w][step]
                buf: torch.Tensor | None = None
                if failure is None:
                    try:
                        buf = self._pack(bucket, slot)
                    except Exception as exc:
                        failure = _packing_failure(exc, me, senders, step, w)
                if buf is None:
                    # After a failure: the receiver's loop still expects these bytes.
                    buf = self._buffer(w, slot, bucket.nbytes)
                ops.append(("send", buf, senders + w))
                sent[w] += bucket.payload_bytes
                count += 1
            # One batch per step: on NCCL one grouped call, so no send of a step
            # waits behind another receiver's (each rank's queue is ordered by step).
            works = self.link.post(ops, f"posting the sends of step {step}")
            # The entries keep zero-copy views alive until their sends are done.
            pending[slot] = [
                (peer - senders, work, buf) for work, (_, buf, peer) in zip(works, ops, strict=True)
            ]
        for slot in (steps % 2, (steps + 1) % 2):  # step n-2's, then step n-1's
            for w, work, _ in pending.get(slot, []):
                self.link.wait(work, f"last sends to inference worker {w}")
        pending.clear()
        return conclude_sender(self.link, plan, me, peers, failure, sent, count)


def _status_of(failure: BaseException | None) -> int:
    """A finish's status: ``_OK`` without a failure."""
    if failure is None:
        return _OK
    return _MISMATCH if isinstance(failure, RefitMismatchError) else _ERROR


class _Receiver:
    """One receiver's side of :func:`run_plan` (see the module docstring)."""

    def __init__(self, link: _Link, plan: Plan, me: int, sink: SinkFn) -> None:
        self.link = link
        self.plan = plan
        self.me = me  # group rank
        self.worker = me - plan.num_senders
        self.sink = sink
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}

    def _buffer(self, src: int, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers.get((src, slot))
        if buf is None:
            size = max(b.nbytes for b in self.plan.buckets_between(src, self.worker))
            buf = torch.empty(size, dtype=torch.uint8, device=self.link.device)
            self.buffers[(src, slot)] = buf
        return buf[:nbytes]

    def _post_step(
        self, lists: dict[int, tuple[TransferBucket, ...]], step: int
    ) -> list[tuple[int, Any, torch.Tensor]]:
        ops: list[tuple[str, torch.Tensor, int]] = []
        for src, buckets in lists.items():
            if step < len(buckets):
                ops.append(("recv", self._buffer(src, step % 2, buckets[step].nbytes), src))
        works = self.link.post(ops, f"posting the receives of step {step}")
        return [(peer, work, buf) for work, (_, buf, peer) in zip(works, ops, strict=True)]

    def _deliver(self, bucket: TransferBucket, buf: torch.Tensor) -> None:
        for t in bucket.transfers:
            raw = buf[t.offset : t.offset + t.nbytes]
            self.sink(t.name, t.box, raw.view(dtype_from_name(t.dtype)).view(box_shape(t.box)))

    def run(self) -> P2PResult:
        plan, senders = self.plan, self.plan.num_senders
        peers = list(range(senders))
        _handshake(self.link, plan, self.me, peers)
        lists = {src: plan.buckets_between(src, self.worker) for src in peers}
        steps = max((len(b) for b in lists.values()), default=0)
        received = dict.fromkeys(peers, 0)
        failure: BaseException | None = None
        count = 0
        posted = {0: self._post_step(lists, 0)} if steps else {}
        for step in range(steps):
            if step + 1 < steps:
                # Step k+1 lands in the buffers step k-1 used, already handed to the sink.
                posted[step + 1] = self._post_step(lists, step + 1)
            for src, work, buf in posted.pop(step):
                self.link.wait(work, f"receive of bucket {step} from trainer rank {src}")
                bucket = lists[src][step]
                received[src] += bucket.payload_bytes
                count += 1
                if failure is None:
                    try:
                        self._deliver(bucket, buf)
                    except Exception as exc:  # keep draining: the senders are mid-stream
                        failure = exc
        return conclude_receiver(self.link, plan, self.me, failure, received, count)


def conclude_sender(
    link: _Link,
    plan: Plan,
    me: int,
    peers: Sequence[int],
    failure: BaseException | None,
    sent: dict[int, int],
    count: int,
    finished: Callable[[], None] | None = None,
) -> P2PResult:
    """A sender's finish with ``peers`` (its receivers' group ranks), then its outcome:
    its own ``failure`` raised; else a receiver that refused what it sent
    (RefitMismatchError), failed to store it, or counted other bytes (TransportError);
    else what it sent (``sent``: payload bytes per receiver index; ``count`` buckets).
    ``finished`` is called once the finish is exchanged, before anything is raised."""
    senders = plan.num_senders
    nbytes = {peer: sent[peer - senders] for peer in peers}
    outcome = _finish(link, plan, me, peers, _status_of(failure), nbytes)
    if finished is not None:
        finished()
    if failure is not None:
        raise failure
    for peer, (code, got) in sorted(outcome.items()):
        who = _describe(peer, senders)
        if code == _MISMATCH:
            raise RefitMismatchError(f"{who} refused what {_describe(me, senders)} sent")
        if code != _OK:
            raise TransportError(f"{who} failed to store what {_describe(me, senders)} sent")
        if got != nbytes[peer]:
            raise TransportError(
                f"{who} received {got} bytes from {_describe(me, senders)}, "
                f"{nbytes[peer]} were sent"
            )
    return P2PResult("sender", sum(sent.values()), sent, count)


def conclude_receiver(
    link: _Link,
    plan: Plan,
    me: int,
    failure: BaseException | None,
    received: dict[int, int],
    count: int,
    finished: Callable[[], None] | None = None,
) -> P2PResult:
    """A receiver's finish with every sender (``received``: payload bytes per sender),
    then its outcome: its own ``failure`` raised; else a sender whose weights differ
    from the plan (RefitMismatchError) or that failed mid-transfer (TransportError);
    else what it received. ``finished`` as for :func:`conclude_sender`."""
    outcome = _finish(link, plan, me, list(received), _status_of(failure), received)
    if finished is not None:
        finished()
    if failure is not None:
        raise failure
    for src, (code, _) in sorted(outcome.items()):
        if code == _MISMATCH:
            reason = f"trainer rank {src}'s weights differ from the plan"
        elif code != _OK:
            reason = f"trainer rank {src} failed mid-transfer"
        else:
            continue
        error = RefitMismatchError if code == _MISMATCH else TransportError
        raise error(f"{reason}; what it sent {_describe(me, plan.num_senders)} is not its weights")
    return P2PResult("receiver", sum(received.values()), received, count)


def check_call(plan: Plan, group: Any, rank: int, timeout_s: float) -> None:
    """The arguments both data planes take, checked before any message moves.

    Raises:
        ValueError: ``timeout_s`` not positive, or ``rank``/``group`` do not fit ``plan``.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    world = plan.num_senders + plan.num_receivers
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a plan of {world} ranks")
    size = getattr(group, "size", None)
    if callable(size) and size() != world:
        raise ValueError(f"the group has {size()} ranks, the plan {world}")
    own = getattr(group, "rank", None)
    if callable(own) and own() != rank:
        raise ValueError(f"this process is rank {own()} of the group, not {rank}")


def run_plan(
    plan: Plan,
    group: Any,
    rank: int,
    *,
    source: SourceFn | None = None,
    sink: SinkFn | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float,
) -> P2PResult:
    """Move this rank's share of ``plan`` over ``group`` (blocking; every rank calls it).

    Ranks ``0..T-1`` of ``group`` send (``T = plan.num_senders``), ranks
    ``T..T+W-1`` receive (``W = plan.num_receivers``); every rank of the group
    takes part, even one with nothing to move (the handshake and finish are
    with every peer). Each ``(sender, receiver)`` pair's buckets travel in plan
    order, two in flight per pair; all senders send at once. All ranks must
    hold plans of the same :attr:`~._plan.Plan.digest` (compare them first: a
    differing pair raises :class:`RefitMismatchError` at its handshake, but a
    rank whose own pairs agree then waits for its peers up to ``timeout_s``).

    Args:
        plan: the plan, from :func:`~._plan.make_plan` on every rank.
        group: a ``torch.distributed`` process group of ``T + W`` ranks in which
            this process is ``rank`` (gloo or NCCL), or a bare backend object
            (``dist.ProcessGroupGloo(store, rank, size, timeout)``).
        rank: this process's rank in ``group``.
        source: on a sender, ``hf_name -> local tensor`` (its part of that
            tensor, ``plan.sources[rank][hf_name].local_shape``, manifest dtype),
            e.g. :func:`~._source_layout.local_tensor_fn`. Asked once per name
            per call; the tensor must not change until the call returns.
        sink: on a receiver, ``(hf_name, box, tensor)`` storing one received box
            (see :data:`SinkFn`); called in bucket order, per sender.
        device: where the byte buffers live (``"cpu"`` for gloo, this rank's
            ``cuda:N`` for NCCL).
        timeout_s: limit of each wait (one post, one bucket, the handshake,
            the finish), seconds.

    Returns:
        What this rank moved (bytes per peer equal ``plan.pair_bytes``).

    Raises:
        ValueError: ``rank`` or ``group`` do not fit the plan, the role's
            callable is missing, or ``timeout_s`` is not positive.
        RefitMismatchError: a peer planned differently (at the handshake); a
            sender's tensor has the wrong shape or dtype (on it and its
            receivers, after the transfer).
        TransportError: a peer died or failed (its ``source`` or ``sink``
            raised: the receivers' data is then not trustworthy); the group is
            then broken, destroy it.
        SyncTimeoutError: a wait ran past ``timeout_s``.
        Exception: on a receiver, what its ``sink`` raised (after draining).
    """
    check_call(plan, group, rank, timeout_s)
    link = _Link(group, timeout_s, torch.device(device))
    if rank < plan.num_senders:
        if source is None:
            raise ValueError(f"{_describe(rank, plan.num_senders)} needs a source")
        return _Sender(link, plan, rank, source).run()
    if sink is None:
        raise ValueError(f"{_describe(rank, plan.num_senders)} needs a sink")
    return _Receiver(link, plan, rank, sink).run()
