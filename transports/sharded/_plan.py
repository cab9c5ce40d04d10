"""The many-senders transfer plan: which box of which HF tensor each sender sends each receiver.

Every trainer rank (a *sender*, ``0..T-1``) describes what it holds as an
:data:`aiosync.layout.Layout`, and so does every inference worker (a *receiver*,
``0..W-1``). :func:`make_plan` intersects them: for each HF tensor and each
receiver's :class:`~aiosync.layout.Part`, the boxes (a ``(start, stop)`` range per
dimension of the full tensor) to move from which sender, each element a receiver
holds covered exactly once. The transfers of each ``(sender, receiver)`` pair are
then packed, in a fixed order, into byte buckets of at most ``bucket_bytes``.

The plan is a pure function of its inputs: every rank computes it on its own and
gets the same plan, whose :attr:`Plan.digest` (SHA-256, hex) the ranks compare
before any byte moves. Ordering never depends on a mapping's insertion order.

A box is the intersection of two one-dimensional cuts (an FSDP2 dim-0 chunk and
a row-parallel dim-1 slice), so it may be cut along two dimensions: it is a
:data:`Box`, not a :class:`~aiosync.layout.Part`. :func:`box_within` turns it into
the index of the box inside a holder's local tensor.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from aiosync._config import PACK_ALIGNMENT_BYTES
from aiosync.errors import RefitMismatchError
from aiosync.layout import Layout, Part, box_of

from ..packing import dtype_from_name, dtype_name

__all__ = [
    "Box",
    "Plan",
    "Transfer",
    "TransferBucket",
    "box_numel",
    "box_shape",
    "box_within",
    "make_plan",
]

#: ``(start, stop)`` per dimension of the full HF tensor (``()`` for a 0-d tensor),
#: as :func:`aiosync.layout.box_of` gives it.
Box = tuple[tuple[int, int], ...]

#: Version of the plan's layout rules, part of the digest: two library versions
#: that would cut or order differently never agree by accident.
_PLAN_FORMAT = 1


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the box's elements (``()`` for a 0-d tensor's box)."""
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    """Number of elements in the box (1 for a 0-d tensor's ``()``, 0 if any range is empty)."""
    n = 1
    for start, stop in box:
        n *= max(0, stop - start)
    return n


def box_within(box: Box, part: Part) -> tuple[slice, ...]:
    """Index of ``box`` inside the local tensor of whoever holds ``part``.

    ``local[box_within(box, part)]`` is the box's view of a holder's local tensor
    (shape ``part.local_shape``); ``()`` for a 0-d tensor, whose index is the
    tensor itself.

    Raises:
        ValueError: ``box`` is not inside ``part`` (or of another rank).
    """
    whole = box_of(part)
    if len(box) != len(whole) or any(
        lo < wlo or hi > whi for (lo, hi), (wlo, whi) in zip(box, whole, strict=True)
    ):
        raise ValueError(f"box {box} is not inside part {part}")
    return tuple(
        slice(lo - part.start, hi - part.start) if d == part.dim else slice(lo, hi)
        for d, (lo, hi) in enumerate(box)
    )


def _intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, None when it holds no element (0-d: ``()``)."""
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one HF tensor, from one sender to one receiver, at a place in a bucket.

    Attributes:
        name: HF checkpoint tensor name.
        shape: the full HF tensor's shape.
        dtype: dtype name as :func:`aiosync.transports.packing.dtype_name` gives it.
        box: the region of the full tensor moved (``(start, stop)`` per dim).
        src: sender index (trainer rank, ``0..T-1``).
        dst: receiver index (inference worker, ``0..W-1``).
        offset: byte offset in its bucket, a multiple of 512.
        nbytes: payload bytes (``box_numel(box) * itemsize``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    src: int
    dst: int
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True, slots=True)
class TransferBucket:
    """One byte buffer between one ``(src, dst)`` pair: the ``index``-th of that pair.

    Attributes:
        src: sender index.
        dst: receiver index.
        index: position among the pair's buckets (the step it travels in).
        transfers: its transfers, by offset.
        nbytes: buffer size, bytes (the last transfer's end, padding included);
            at most the plan's ``bucket_bytes`` unless one element is larger.
    """

    src: int
    dst: int
    index: int
    transfers: tuple[Transfer, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(t.nbytes for t in self.transfers)


@dataclass(frozen=True, eq=False)
class Plan:
    """The transfer plan of one refit, identical on every rank for the same inputs.

    Compare plans by :attr:`digest`.

    Attributes:
        num_senders: ``T``, the trainer ranks (group ranks ``0..T-1``).
        num_receivers: ``W``, the inference workers (group ranks ``T..T+W-1``).
        bucket_bytes: the bucket size limit it was planned with, bytes.
        sources: each sender's layout, by sender index (names sorted).
        destinations: each receiver's layout, by receiver index (names sorted).
        buckets: ``{(src, dst): buckets in send order}``; only pairs that move data.
        digest: SHA-256 (hex) over the counts, the limit and every transfer.
    """

    num_senders: int
    num_receivers: int
    bucket_bytes: int
    sources: tuple[Mapping[str, Part], ...]
    destinations: tuple[Mapping[str, Part], ...]
    buckets: Mapping[tuple[int, int], tuple[TransferBucket, ...]]
    digest: str
    _pair_bytes: dict[tuple[int, int], int] = field(repr=False, default_factory=dict)

    def buckets_between(self, src: int, dst: int) -> tuple[TransferBucket, ...]:
        """The buckets sender ``src`` sends receiver ``dst``, in order (maybe none)."""
        return self.buckets.get((src, dst), ())

    def transfers(self) -> Iterator[Transfer]:
        """Every transfer, pair by pair (sorted by ``(src, dst)``), in bucket order."""
        for pair in sorted(self.buckets):
            for bucket in self.buckets[pair]:
                yield from bucket.transfers

    def pair_bytes(self, src: int, dst: int) -> int:
        """Payload bytes sender ``src`` sends receiver ``dst`` (no padding)."""
        return self._pair_bytes.get((src, dst), 0)

    @property
    def pair_nbytes(self) -> dict[tuple[int, int], int]:
        """``{(src, dst): payload bytes}`` for every pair that moves data."""
        return dict(self._pair_bytes)

    @property
    def receiver_nbytes(self) -> tuple[int, ...]:
        """Payload bytes each receiver gets, by receiver index (what its parts hold)."""
        totals = [0] * self.num_receivers
        for (_, dst), n in self._pair_bytes.items():
            totals[dst] += n
        return tuple(totals)

    @property
    def sender_nbytes(self) -> tuple[int, ...]:
        """Payload bytes each sender sends, by sender index (the balance across senders)."""
        totals = [0] * self.num_senders
        for (src, _), n in self._pair_bytes.items():
            totals[src] += n
        return tuple(totals)

    @property
    def total_nbytes(self) -> int:
        """Payload bytes of the whole plan."""
        return sum(self._pair_bytes.values())

    @property
    def max_bucket_nbytes(self) -> int:
        """Largest bucket buffer, bytes (0 for a plan that moves nothing)."""
        return max((b.nbytes for bs in self.buckets.values() for b in bs), default=0)


def _align(n: int) -> int:
    return -(-n // PACK_ALIGNMENT_BYTES) * PACK_ALIGNMENT_BYTES


def _shapes(
    sources: Sequence[Layout], destinations: Sequence[Layout]
) -> dict[str, tuple[int, ...]]:
    """Each name's full shape, checked to agree everywhere.

    Raises:
        RefitMismatchError: two holders disagree on a tensor's shape.
    """
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    sides = [(f"trainer rank {i}", lay) for i, lay in enumerate(sources)] + [
        (f"inference worker {w}", lay) for w, lay in enumerate(destinations)
    ]
    for who, layout in sides:
        for name in sorted(layout):
            shape = tuple(layout[name].shape)
            seen = shapes.setdefault(name, (shape, who))
            if seen[0] != shape:
                raise RefitMismatchError(
                    f"{name}: {seen[1]} holds it as shape {seen[0]}, {who} as {shape}"
                )
    return {name: shape for name, (shape, _) in shapes.items()}


def _cells(dest: Box, holders: Sequence[tuple[int, Box]]) -> list[tuple[Box, tuple[int, ...]]]:
    """Cut ``dest`` where any holder's box starts or ends inside it; each cell's holders.

    A cell lies wholly inside or outside every holder's box, so it is the unit
    that one sender sends. Work is linear in the cells each holder covers
    (bisect on the cut points), not cells × holders.
    """
    clipped = [(i, box) for i, h in holders if (box := _intersect(dest, h)) is not None]
    cuts = [
        sorted({lo, hi, *(b[d][0] for _, b in clipped), *(b[d][1] for _, b in clipped)})
        for d, (lo, hi) in enumerate(dest)
    ]
    owners: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, box in clipped:
        spans = [
            range(bisect.bisect_left(c, lo), bisect.bisect_left(c, hi))
            for c, (lo, hi) in zip(cuts, box, strict=True)
        ]
        for cell in itertools.product(*spans):
            owners[cell].append(i)
    return [
        (tuple((c[k], c[k + 1]) for c, k in zip(cuts, cell, strict=True)), tuple(owners[cell]))
        for cell in itertools.product(*(range(len(c) - 1) for c in cuts))
    ]


def _merge(pieces: list[tuple[Box, int]]) -> list[tuple[Box, int]]:
    """Join boxes of the same sender that touch along one dim and match on the others.

    One pass per dim, last dim first, so a grid of cells from one sender becomes
    one box again; the result is sorted by box.
    """
    if not pieces or not pieces[0][0]:
        return sorted(pieces)
    for d in reversed(range(len(pieces[0][0]))):
        rows: dict[tuple[int, Box], list[Box]] = defaultdict(list)
        for box, src in pieces:
            rows[(src, box[:d] + box[d + 1 :])].append(box)
        merged: list[tuple[Box, int]] = []
        for (src, _), boxes in rows.items():
            boxes.sort()
            run = boxes[0]
            for box in boxes[1:]:
                if box[d][0] == run[d][1]:
                    run = (*run[:d], (run[d][0], box[d][1]), *run[d + 1 :])
                else:
                    merged.append((run, src))
                    run = box
            merged.append((run, src))
        pieces = merged
    return sorted(pieces)


def _split(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Cut ``box`` into pieces of at most ``limit`` bytes, along its outermost dims.

    The outermost dim ``d`` whose one index (a slab of the dims after it) fits
    in ``limit`` is cut into runs of as many indices as fit; the dims before
    ``d`` into single indices. A piece is then one box, contiguous in a row-major
    copy of the full tensor when ``d`` is 0. A single element larger than
    ``limit`` travels alone.
    """
    shape = box_shape(box)
    if not box or box_numel(box) * itemsize <= limit:
        return [box]
    d = len(box) - 1
    slab = itemsize
    for k in range(len(box)):
        size = itemsize
        for n in shape[k + 1 :]:
            size *= n
        if size <= limit:
            d, slab = k, size
            break
    per = max(1, limit // slab)
    lo, hi = box[d]
    pieces: list[Box] = []
    for outer in itertools.product(*(range(a, b) for a, b in box[:d])):
        head = tuple((i, i + 1) for i in outer)
        for start in range(lo, hi, per):
            pieces.append((*head, (start, min(start + per, hi)), *box[d + 1 :]))
    return pieces


def make_plan(
    sources: Sequence[Layout],
    destinations: Sequence[Layout],
    dtypes: Mapping[str, torch.dtype],
    bucket_bytes: int,
) -> Plan:
    """Plan the boxes every sender sends every receiver, packed in buckets (pure, deterministic).

    For each HF tensor a receiver holds (a non-empty :class:`~aiosync.layout.Part`),
    its part is cut where sources' parts start or end; each piece goes from one
    sender that holds it. A piece only one sender holds is sent by it; a piece
    several hold (replicas) goes to the one with the fewest bytes assigned so
    far, ties broken round-robin (a cursor over the senders), after every
    single-holder piece is counted, so replicated tensors spread across all
    senders. Pieces of one tensor from one sender to one receiver are merged
    back into one box where they touch.

    Each ``(sender, receiver)`` pair's transfers, in (name, box) order, fill
    buckets of at most ``bucket_bytes`` bytes, each transfer at an offset aligned
    to 512 bytes. A transfer larger than ``bucket_bytes`` is split along its
    outermost dimension(s) (see ``_split``) so that no buffer outgrows the
    limit; only a single element larger than the limit gets a bigger bucket.

    Args:
        sources: each trainer rank's layout (index = sender index), e.g. from
            :func:`~aiosync.transports.sharded.dtensor_layouts`.
        destinations: each inference worker's layout (index = receiver index),
            as the engine reports it.
        dtypes: the manifest dtype of each tensor sent (``{hf_name: dtype}``, as
            ``prepare_refit_info()`` gives; other names are ignored).
        bucket_bytes: limit of one bucket, bytes (> 0).

    Returns:
        The plan; names, senders and receivers are ordered by name and index,
        never by a mapping's insertion order.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
        RefitMismatchError: a receiver holds a tensor no sender holds, or that
            has no dtype; two holders disagree on a tensor's shape; or some
            region of a receiver's part is held by no sender (naming the tensor,
            the worker and the region).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    shapes = _shapes(sources, destinations)
    wanted = sorted({name for layout in destinations for name in layout})
    # Pass 1: cells of every receiver's part and their holders.
    assigned: dict[tuple[str, int], list[tuple[Box, int]]] = defaultdict(list)
    shared: list[tuple[str, int, Box, tuple[int, ...]]] = []
    load = [0] * len(sources)
    itemsize: dict[str, int] = {}
    cells_memo: dict[
        tuple[Box, tuple[tuple[int, Box], ...]], list[tuple[Box, tuple[int, ...]]]
    ] = {}
    for name in wanted:
        if name not in dtypes:
            raise RefitMismatchError(
                f"{name}: an inference worker holds it, the manifest has no dtype for it"
            )
        itemsize[name] = dtypes[name].itemsize
        holders = [
            (i, box_of(layout[name]))
            for i, layout in enumerate(sources)
            if name in layout and layout[name].numel > 0
        ]
        for w, layout in enumerate(destinations):
            part = layout.get(name)
            if part is None or part.numel == 0:
                continue
            if not holders:
                raise RefitMismatchError(
                    f"{name}: inference worker {w} holds {box_of(part)} of it, "
                    "no trainer rank holds any"
                )
            # Layers repeat the same shapes and cuts: cut each distinct case once.
            key = (box_of(part), tuple(holders))
            if key not in cells_memo:
                cells_memo[key] = _cells(key[0], holders)
            for cell, owners in cells_memo[key]:
                if not owners:
                    raise RefitMismatchError(
                        f"{name}: region {cell} of inference worker {w}'s part {box_of(part)} "
                        "is held by no trainer rank"
                    )
                if len(owners) == 1:
                    assigned[(name, w)].append((cell, owners[0]))
                    load[owners[0]] += box_numel(cell) * itemsize[name]
                else:
                    shared.append((name, w, cell, owners))
    # Pass 2: replicated cells to the least-loaded holder, ties round-robin.
    cursor = 0
    for name, w, cell, owners in shared:
        pick = min(owners, key=lambda i: (load[i], (i - cursor) % len(sources)))
        cursor = (pick + 1) % len(sources)
        assigned[(name, w)].append((cell, pick))
        load[pick] += box_numel(cell) * itemsize[name]
    # Merge, split to the bucket size, and group by pair in (name, box) order.
    per_pair: dict[tuple[int, int], list[tuple[str, Box]]] = defaultdict(list)
    for (name, w), pieces in sorted(assigned.items()):
        for box, src in _merge(pieces):
            for piece in _split(box, itemsize[name], bucket_bytes):
                per_pair[(src, w)].append((name, piece))
    buckets: dict[tuple[int, int], tuple[TransferBucket, ...]] = {}
    pair_bytes: dict[tuple[int, int], int] = {}
    digest = hashlib.sha256()
    digest.update(
        json.dumps([_PLAN_FORMAT, len(sources), len(destinations), bucket_bytes]).encode()
    )
    for (src, dst), items in sorted(per_pair.items()):
        items.sort()
        done: list[TransferBucket] = []
        slots: list[Transfer] = []
        end = 0
        for name, box in items:
            nbytes = box_numel(box) * itemsize[name]
            offset = _align(end) if slots else 0
            if slots and offset + nbytes > bucket_bytes:
                done.append(TransferBucket(src, dst, len(done), tuple(slots), end))
                slots, offset = [], 0
            slots.append(
                Transfer(
                    name, shapes[name], dtype_name(dtypes[name]), box, src, dst, offset, nbytes
                )
            )
            end = offset + nbytes
        done.append(TransferBucket(src, dst, len(done), tuple(slots), end))
        buckets[(src, dst)] = tuple(done)
        pair_bytes[(src, dst)] = sum(b.payload_bytes for b in done)
        entries = [
            [src, dst, b.index, t.name, t.shape, t.dtype, t.box, t.offset]
            for b in done
            for t in b.transfers
        ]
        digest.update(json.dumps(entries).encode())
    return Plan(
        num_senders=len(sources),
        num_receivers=len(destinations),
        bucket_bytes=bucket_bytes,
        sources=tuple({n: lay[n] for n in sorted(lay)} for lay in sources),
        destinations=tuple({n: lay[n] for n in sorted(lay)} for lay in destinations),
        buckets=buckets,
        digest=digest.hexdigest(),
        _pair_bytes=pair_bytes,
    )
