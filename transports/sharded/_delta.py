"""Delta syncs on the many-senders plan: each sender sends each receiver only what changed.

Each trainer rank keeps a :class:`ShardBaseline`, the bits of the local tensors it sends
(its shard, in host memory) as of the last version committed on every worker. A delta
sync replays the same :class:`~._plan.Plan` as a full one, but per transfer (one box of
one tensor, from one sender to one receiver) only the box's changed elements move, as
flat row-major indices in the FULL tensor's coordinates plus their values
(:class:`aiosync.delta.WeightPatch`'s ``indices`` encoding), or the box dense when that
is smaller. Between every sender and every receiver that share transfers, in order::

    handshake  int64[9] both ways        as a full plan's (:mod:`._p2p`), another magic
    header     int64[n] sender -> recv   per transfer of the pair, in plan order: the
                                         changed elements (0: unchanged), or -1: dense
    payload    uint8[...] sender -> recv  per transfer: indices (int32; int64 past 2**31
                                         elements) then values, or the dense box; each
                                         piece at a 16-byte aligned offset
    finish     int64[4] both ways        as a full plan's: status, payload bytes

The payload's size and layout follow from the plan and the header alone (both ends
compute them with ``_pieces``); one message per pair (a delta is small; a receiver
holds at most its slices' bytes of it at once). The link, its timeouts and its typed
errors (:class:`~._p2p.LinkLost`, :class:`~._p2p.LinkTimeout`) are :mod:`._p2p`'s.
A receiver that must refuse the delta (it does not hold the patches' base) still
drains every message and writes nothing, then reports the refusal in its finish.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aiosync.delta import DeltaBaseline, WeightPatch, _bits, _changed
from aiosync.errors import RefitMismatchError, SyncError, TransportError
from aiosync.layout import Part

from ._p2p import (
    LinkLost,
    P2PResult,
    SourceFn,
    _describe,
    _handshake,
    _Link,
    check_call,
    conclude_receiver,
    conclude_sender,
)
from ._plan import Box, Plan, Transfer, box_numel, box_shape, box_within

__all__ = [
    "DENSE",
    "ApplyFn",
    "ShardBaseline",
    "encode_transfer",
    "run_delta_plan",
]

#: The header's count of a transfer sent dense (its whole box).
DENSE = -1
#: "aiospdl" + wire format 1: a delta's handshake (a full plan's differs).
_DELTA_MAGIC = 0x6169_6F73_7064_6C01
#: Alignment of every payload piece, bytes (the widest element a view may need).
_ALIGN = 16

#: ``apply(boxes, patches)`` on a receiver: write one sender's dense boxes
#: (``(hf_name, box, tensor)``, as ``load_weight_boxes`` takes them) and sparse
#: patches (full-tensor coordinates, as ``apply_weight_patches`` takes them). The
#: tensors are views into a receive buffer, valid only during the call.
ApplyFn = Callable[[list[tuple[str, Box, torch.Tensor]], list[WeightPatch]], None]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _index_dtype(shape: Sequence[int]) -> torch.dtype:
    """Dtype of a full tensor's flat indices (int32 below 2**31 elements)."""
    return torch.int32 if _numel(shape) < 2**31 else torch.int64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ShardBaseline(DeltaBaseline):
    """A sender's :class:`~aiosync.delta.DeltaBaseline` of its LOCAL tensors: the bits of
    every tensor it sends (its part, ``local_shape``), host memory.

    Costs one host copy of what this rank sends (about its shard), plus a second
    during a full sync until it commits; during a delta sync only the staged
    changes. Its staged patches are in the local tensors' coordinates (the
    transfers' patches, in full-tensor coordinates, are :func:`encode_transfer`'s).
    """

    def stage_source(self, version: int, source: SourceFn) -> SourceFn:
        """A full sync of ``version`` reads its local tensors through the returned
        ``source``, which copies each one's bits as it passes, for :meth:`commit`."""
        staged: dict[str, torch.Tensor] = {}
        self._staged = (version, staged, [])

        def read(name: str) -> torch.Tensor:
            tensor = source(name)
            staged[name] = _bits(tensor).to("cpu", copy=True)
            return tensor

        return read

    def changed(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``bool[local.shape]``: which elements of ``local`` (host memory) differ
        bitwise from the baseline.

        Raises:
            RefitMismatchError: no baseline, ``name`` is not in it, or ``local`` has
                another element count or size than its baseline.
        """
        if self.version is None:
            raise RefitMismatchError("no committed baseline: the next sync must be full")
        old = self._bits.get(name)
        if old is None:
            raise RefitMismatchError(f"{name!r} is not in this rank's delta baseline")
        new = _bits(local)
        if new.shape != old.shape or new.dtype != old.dtype:
            raise RefitMismatchError(
                f"{name}: {tuple(local.shape)} {local.dtype} differs from its baseline's layout"
            )
        return _changed(old, new)[0].view(local.shape)

    @staticmethod
    def local_patch(name: str, base: int, local: torch.Tensor, mask: torch.Tensor) -> WeightPatch:
        """The change of one local tensor (``mask`` from :meth:`changed`) as a patch in
        its local coordinates, for :meth:`~aiosync.delta.DeltaBaseline.stage`: the
        changed elements' int64 indices and values, or, when that is larger, a copy
        of the whole tensor."""
        flat = mask.reshape(-1).nonzero().view(-1)
        shape = tuple(local.shape)
        if flat.numel() * (8 + local.element_size()) >= local.numel() * local.element_size():
            return WeightPatch(name, base, shape, "dense", local.detach().clone())
        return WeightPatch(name, base, shape, "indices", local.reshape(-1)[flat], flat)


def encode_transfer(
    transfer: Transfer, held: Part, local: torch.Tensor, mask: torch.Tensor
) -> tuple[int, list[torch.Tensor]]:
    """One transfer's count and wire tensors: the changed elements of its box.

    Args:
        transfer: the box (full-tensor coordinates) this sender sends one receiver.
        held: the sender's :class:`~aiosync.layout.Part` of the tensor (``local``'s).
        local: the sender's local tensor (``held.local_shape``), host memory.
        mask: ``bool[held.local_shape]``, the changed elements (:meth:`ShardBaseline.changed`).

    Returns:
        ``(0, [])`` when nothing in the box changed; ``(k, [indices, values])``:
        ``k`` flat row-major indices into the FULL tensor (int32, or int64 past
        2**31 elements), ascending, and their new values; or ``(DENSE, [box])``,
        the box's elements, when they take no more bytes than the indices and
        values (ties go dense).
    """
    index = box_within(transfer.box, held)
    sub = mask[index]
    coords = sub.nonzero()
    k = int(coords.shape[0])
    if k == 0:
        return 0, []
    size = local.element_size()
    where_dtype = _index_dtype(transfer.shape)
    where_size = torch.empty((), dtype=where_dtype).element_size()
    box = local[index]
    if box_numel(transfer.box) * size <= k * (where_size + size):
        return DENSE, [box.contiguous()]
    flat = torch.zeros(k, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(transfer.shape))):
        flat += (coords[:, d] + transfer.box[d][0]) * stride
        stride *= transfer.shape[d]
    return k, [flat.to(where_dtype), box[sub]]


@dataclass(frozen=True, slots=True)
class _Piece:
    """One wire tensor of a pair's payload: of transfer ``transfer``, at ``offset``."""

    transfer: int
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _pieces(transfers: Sequence[Transfer], counts: Sequence[int]) -> tuple[list[_Piece], int]:
    """The payload's pieces and its size in bytes (padding included), from the
    plan's transfers of one pair and the header's counts (both ends agree)."""
    pieces: list[_Piece] = []
    end = 0
    for i, (t, count) in enumerate(zip(transfers, counts, strict=True)):
        if count == DENSE:
            layout = [(t.torch_dtype, box_numel(t.box))]
        elif count > 0:
            layout = [(_index_dtype(t.shape), count), (t.torch_dtype, count)]
        else:
            continue
        for dtype, numel in layout:
            offset = _align(end)
            pieces.append(_Piece(i, dtype, numel, offset))
            end = offset + numel * dtype.itemsize
    return pieces, end


def _pair_transfers(plan: Plan, src: int, dst: int) -> list[Transfer]:
    """The pair's transfers in plan order (bucket by bucket): the header's order."""
    return [t for b in plan.buckets_between(src, dst) for t in b.transfers]


@dataclass(eq=False)
class _DeltaSender:
    """One sender's side of :func:`run_delta_plan`."""

    link: _Link
    plan: Plan
    me: int
    source: SourceFn
    baseline: ShardBaseline
    version: int

    def __post_init__(self) -> None:
        self.layout = self.plan.sources[self.me]
        #: Each receiver's transfers from this sender, in the header's order.
        self.transfers = {
            w: _pair_transfers(self.plan, self.me, w) for w in range(self.plan.num_receivers)
        }

    def _encode(self) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        """Every pair's counts and wire tensors; stages this rank's local changes."""
        base = self.baseline.version
        assert base is not None
        who = _describe(self.me, self.plan.num_senders)
        uses = Counter(t.name for ts in self.transfers.values() for t in ts)
        # Each local tensor is read and diffed once, and dropped after its last box.
        cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        staged: list[WeightPatch] = []
        out: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for w, transfers in self.transfers.items():
            counts: list[int] = []
            tensors: list[torch.Tensor] = []
            for t in transfers:
                if t.name not in cache:
                    part = self.layout[t.name]
                    local = self.source(t.name).detach()
                    if tuple(local.shape) != part.local_shape or local.dtype != t.torch_dtype:
                        raise RefitMismatchError(
                            f"{t.name}: {who} gave {tuple(local.shape)} {local.dtype}, its "
                            f"part needs {part.local_shape} {t.torch_dtype}"
                        )
                    # The baseline is in host memory: compare there (a GPU tensor moves once).
                    local = local.to("cpu")
                    mask = self.baseline.changed(t.name, local)
                    if bool(mask.any()):
                        staged.append(ShardBaseline.local_patch(t.name, base, local, mask))
                    cache[t.name] = (local, mask)
                local, mask = cache[t.name]
                count, wire = encode_transfer(t, self.layout[t.name], local, mask)
                counts.append(count)
                tensors += wire
                uses[t.name] -= 1
                if uses[t.name] <= 0:
                    del cache[t.name]
            out[w] = (counts, tensors)
        self.baseline.stage(self.version, staged)
        return out

    def _pack(self, w: int, counts: list[int], tensors: list[torch.Tensor]) -> torch.Tensor | None:
        pieces, size = _pieces(self.transfers[w], counts)
        if size == 0:
            return None
        buf = torch.zeros(size, dtype=torch.uint8)
        for piece, tensor in zip(pieces, tensors, strict=True):
            raw = buf[piece.offset : piece.offset + piece.nbytes]
            raw.view(piece.dtype).copy_(tensor.reshape(-1))
        return buf.to(self.link.device)

    def run(self) -> P2PResult:
        plan, me, senders = self.plan, self.me, self.plan.num_senders
        receivers = plan.num_receivers
        order = [(me + k) % receivers for k in range(receivers)]
        peers = [senders + w for w in order]
        _handshake(self.link, plan, me, peers, _DELTA_MAGIC)
        failure: SyncError | None = None
        encoded: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        buffers: dict[int, torch.Tensor] = {}
        try:
            encoded = self._encode()
            for w, (counts, tensors) in encoded.items():
                buf = self._pack(w, counts, tensors)
                if buf is not None:
                    buffers[w] = buf
        except SyncError as exc:
            failure = exc
        except Exception as exc:
            failure = TransportError(
                f"{_describe(me, senders)} failed computing its delta: {exc!r}"
            )
        if failure is not None:
            # Every receiver still expects a header: nothing changed, no payload follows.
            encoded = {w: ([0] * len(ts), []) for w, ts in self.transfers.items()}
            buffers = {}
        headers = {
            w: torch.tensor(encoded[w][0], dtype=torch.int64).to(self.link.device)
            for w in order
            if self.transfers[w]
        }
        # Two batches, as the receiver posts them (it sizes the payload from the header).
        for what, messages in (("header", headers), ("payload", buffers)):
            ops = [("send", messages[w], senders + w) for w in order if w in messages]
            works = self.link.post(ops, f"posting the delta {what}s")
            for work, (_, _, peer) in zip(works, ops, strict=True):
                self.link.wait(work, f"delta {what} to {_describe(peer, senders)}")
        sent = dict.fromkeys(range(receivers), 0)
        for w, (counts, _) in encoded.items():
            pieces, _ = _pieces(self.transfers[w], counts)
            sent[w] = sum(p.nbytes for p in pieces)
        return conclude_sender(self.link, plan, me, peers, failure, sent, len(buffers))


@dataclass(eq=False)
class _DeltaReceiver:
    """One receiver's side of :func:`run_delta_plan`."""

    link: _Link
    plan: Plan
    me: int
    base: int
    apply: ApplyFn
    refusal: BaseException | None
    finish: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.worker = self.me - self.plan.num_senders

    def _counts(self, src: int, transfers: Sequence[Transfer], header: torch.Tensor) -> list[int]:
        counts = [int(c) for c in header.cpu().tolist()]
        for t, count in zip(transfers, counts, strict=True):
            if count != DENSE and not 0 <= count <= box_numel(t.box):
                # The payload's size is unknown: the pair's stream cannot be drained.
                raise LinkLost(
                    f"bad delta header from trainer rank {src}: {count} changed elements "
                    f"of {t.name}'s box {t.box} ({box_numel(t.box)} elements)"
                )
        return counts

    def _decode(
        self, transfers: Sequence[Transfer], counts: Sequence[int], buf: torch.Tensor
    ) -> tuple[list[tuple[str, Box, torch.Tensor]], list[WeightPatch]]:
        pieces, _ = _pieces(transfers, counts)
        views: dict[int, list[torch.Tensor]] = {}
        for p in pieces:
            views.setdefault(p.transfer, []).append(
                buf[p.offset : p.offset + p.nbytes].view(p.dtype)
            )
        boxes: list[tuple[str, Box, torch.Tensor]] = []
        patches: list[WeightPatch] = []
        for i, wire in views.items():
            t = transfers[i]
            if counts[i] == DENSE:
                boxes.append((t.name, t.box, wire[0].view(box_shape(t.box))))
            else:
                where, values = wire
                patches.append(WeightPatch(t.name, self.base, t.shape, "indices", values, where))
        return boxes, patches

    def run(self) -> P2PResult:
        plan, senders = self.plan, self.plan.num_senders
        peers = list(range(senders))
        _handshake(self.link, plan, self.me, peers, _DELTA_MAGIC)
        lists = {src: _pair_transfers(plan, src, self.worker) for src in peers}
        device = self.link.device
        headers = {
            src: torch.zeros(len(ts), dtype=torch.int64, device=device)
            for src, ts in lists.items()
            if ts
        }
        ops = [("recv", h, src) for src, h in headers.items()]
        works = self.link.post(ops, "posting the delta header receives")
        for work, (_, _, src) in zip(works, ops, strict=True):
            self.link.wait(work, f"delta header from trainer rank {src}")
        counts = {src: self._counts(src, lists[src], h) for src, h in headers.items()}
        buffers: dict[int, torch.Tensor] = {}
        received = dict.fromkeys(peers, 0)
        for src, c in counts.items():
            pieces, size = _pieces(lists[src], c)
            received[src] = sum(p.nbytes for p in pieces)
            if size:
                buffers[src] = torch.empty(size, dtype=torch.uint8, device=device)
        ops = [("recv", buf, src) for src, buf in buffers.items()]
        works = self.link.post(ops, "posting the delta payload receives")
        for work, (_, _, src) in zip(works, ops, strict=True):
            self.link.wait(work, f"delta payload from trainer rank {src}")
        # A refusal was decided before anything moved: nothing is written then.
        failure = self.refusal
        if failure is None:
            try:
                for src in sorted(buffers):
                    self.apply(*self._decode(lists[src], counts[src], buffers[src]))
                if self.finish is not None:
                    self.finish()
            except Exception as exc:  # the finish still tells every sender
                failure = exc
        return conclude_receiver(self.link, plan, self.me, failure, received, len(buffers))


def run_delta_plan(
    plan: Plan,
    group: object,
    rank: int,
    *,
    base: int,
    version: int = 0,
    source: SourceFn | None = None,
    baseline: ShardBaseline | None = None,
    apply: ApplyFn | None = None,
    finish: Callable[[], None] | None = None,
    refusal: BaseException | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float,
) -> P2PResult:
    """Move this rank's share of a delta of ``plan`` over ``group`` (blocking; every rank
    calls it, as :func:`~._p2p.run_plan`).

    Args:
        plan: the plan every rank holds (the same digest).
        group: as for :func:`~._p2p.run_plan`.
        rank: this process's rank in ``group``.
        base: the version the patches are computed against (every rank the same).
        version: on a sender, the version being sent (staged into ``baseline``).
        source: on a sender, ``hf_name -> local tensor`` (as for ``run_plan``).
        baseline: on a sender, its :class:`ShardBaseline` at version ``base``; the
            changes are staged into it (:meth:`~aiosync.delta.DeltaBaseline.commit`
            once the sync committed everywhere).
        apply: on a receiver, writes one sender's boxes and patches (:data:`ApplyFn`).
        finish: on a receiver, called after every sender's were applied, before the
            outcome is reported (a model that stages patches makes them live).
        refusal: on a receiver, a reason decided before the call to write nothing
            (it drains every message, then fails with it, reported to the senders).
        device: where the messages' buffers live.
        timeout_s: limit of each wait, seconds.

    Returns:
        What this rank moved: payload bytes (indices, values and dense boxes; no
        headers, no padding), per peer.

    Raises:
        ValueError: as for ``run_plan``, or the role's arguments are missing.
        RefitMismatchError: a peer planned differently or speaks the full wire
            format (at the handshake); a sender's tensor differs from its part or
            its baseline; a receiver refused.
        TransportError: a peer died or failed (the group is then broken);
            :class:`~._p2p.LinkLost` for a header whose payload cannot be sized.
        SyncTimeoutError: a wait ran past ``timeout_s``.
        Exception: on a receiver, what ``apply`` raised (after draining).
    """
    check_call(plan, group, rank, timeout_s)
    link = _Link(group, timeout_s, torch.device(device))
    who = _describe(rank, plan.num_senders)
    if rank < plan.num_senders:
        if source is None or baseline is None:
            raise ValueError(f"{who} needs a source and a baseline")
        if baseline.version != base:
            raise ValueError(f"{who}'s baseline holds version {baseline.version}, not {base}")
        return _DeltaSender(link, plan, rank, source, baseline, version).run()
    if apply is None:
        raise ValueError(f"{who} needs an apply")
    return _DeltaReceiver(link, plan, rank, base, apply, refusal, finish).run()
