"""Per-bucket checks of what a transport delivered (``verify=``), and their test fault.

Every transport that moves buckets takes ``verify``:

- ``"sample"``: the sender digests a sample of each packed bucket,
  the receiver the same sample of what it received, after its copy out of it. The
  sample is the first and last byte of every tensor slot plus a run of
  :data:`SAMPLE_RUN` consecutive bytes at a random place in each of
  ``SAMPLE_BYTES / SAMPLE_RUN`` equal strides of the bucket, drawn afresh for every
  sync and bucket (seeded by both), so its cost does not grow with the bucket (runs,
  not lone bytes: drawing and sorting 512 places costs a fraction of 4096, and a
  bucket's digest is on every sync's path). It always catches what a transport bug
  does in bulk (a zeroed, stale, shifted, truncated or swapped bucket or tensor, any
  corrupted span of at least two strides); a lone flipped byte of an ``n``-byte
  bucket is caught with probability ``SAMPLE_BYTES / n`` per sync (every byte of a
  bucket of at most ``SAMPLE_BYTES``), and a fault that stays put (a bad page) by
  one of the next syncs.
- ``True`` (the default of the IPC and collective transports): every byte, by the
  block-sum digest (:class:`aiosync._digest.BlockDigest`): certain to catch any change
  confined to one 64-bit word (a lone flipped bit or byte anywhere), and bulk faults
  unless their weighted sums cancel exactly. The sender digests each chunk of a bucket
  as it packs it (:func:`~aiosync.transports.packing.pack`, 1 MiB at a time, still in
  cache) and an IPC worker each tensor as its ``load_weights`` took it, so it costs a
  few percent of a sync (``benchmarks/verify.py``); on a GPU it runs as device kernels.
- ``False``: no check.

``"sample"``'s digest is xxHash's XXH3-64 (the ``xxhash`` library) of the sampled
bytes, as a signed int64 (it travels in int64 tensors): equal on every device, since
it is computed on host bytes. Both digests are computed the same way on every side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

import numpy as np
import torch
import xxhash

from aiosync._digest import BlockDigest

__all__ = [
    "SAMPLE_BYTES",
    "SAMPLE_RUN",
    "Verify",
    "arm_transit_fault",
    "bucket_digest",
    "check_verify",
    "disarm_transit_faults",
    "sample_key",
    "slots_digest",
    "transit_fault",
    "transit_fault_armed",
    "verify_label",
    "views_digest",
]

Verify: TypeAlias = bool | Literal["sample"]

#: Bytes drawn at random per bucket in ``"sample"`` mode, besides the first and
#: last byte of every tensor slot.
SAMPLE_BYTES = 4096
#: They are drawn as runs of this many consecutive bytes, one run per stride.
SAMPLE_RUN = 8

_INT64 = 1 << 64


def check_verify(verify: object) -> Verify:
    """``verify`` itself when it is ``True``, ``False`` or ``"sample"``.

    Raises:
        ValueError: anything else (before any byte moves).
    """
    if verify is True or verify is False or verify == "sample":
        return verify
    raise ValueError(f"verify must be True, False or 'sample', got {verify!r}")


def verify_label(verify: Verify) -> str:
    """``"full"``, ``"sample"`` or ``"off"``: how a message names the mode."""
    return "full" if verify is True else "off" if verify is False else "sample"


def sample_positions(nbytes: int, key: int, slots: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The sorted, distinct byte positions of an ``nbytes``-byte bucket that
    ``"sample"`` digests (int64, CPU): each slot's ``(offset, nbytes)`` first and
    last byte, and a run of :data:`SAMPLE_RUN` bytes drawn with seed ``key`` in each
    of ``SAMPLE_BYTES / SAMPLE_RUN`` equal strides of the bucket (a lone flipped byte
    is then caught with probability ``SAMPLE_BYTES / nbytes`` exactly); every byte of
    a bucket of at most ``SAMPLE_BYTES``."""
    return torch.from_numpy(_positions(nbytes, key, slots))


def _positions(nbytes: int, key: int, slots: Sequence[tuple[int, int]]) -> np.ndarray:
    """:func:`sample_positions` as a numpy array: numpy's per-call cost is a fraction
    of torch's, and this runs for every bucket of every sync on both sides."""
    if nbytes <= SAMPLE_BYTES:
        return np.arange(nbytes, dtype=np.int64)
    ends = np.array(
        [p for offset, size in slots if size > 0 for p in (offset, offset + size - 1)],
        dtype=np.int64,
    )
    runs = SAMPLE_BYTES // SAMPLE_RUN
    generator = torch.Generator().manual_seed(key % (1 << 63))
    bounds = np.arange(runs + 1, dtype=np.int64) * nbytes // runs
    # Each stride holds at least SAMPLE_RUN bytes (nbytes > SAMPLE_BYTES): a run fits.
    room = bounds[1:] - bounds[:-1] - (SAMPLE_RUN - 1)
    unit = torch.rand(runs, dtype=torch.float64, generator=generator).numpy()
    starts = bounds[:-1] + (unit * room).astype(np.int64)
    drawn = (starts[:, None] + _RUN).reshape(-1)
    # Two sorted runs (drawn, ends): the stable sort (timsort) merges them in one pass.
    positions = np.sort(np.concatenate([drawn, ends]), kind="stable")
    return positions[np.concatenate([[True], positions[1:] != positions[:-1]])]


_RUN = np.arange(SAMPLE_RUN, dtype=np.int64)


def bucket_digest(
    buffer: torch.Tensor,
    verify: Verify,
    *,
    key: int = 0,
    slots: Sequence[tuple[int, int]] = (),
) -> int:
    """The digest of a packed bucket, a signed int64.

    Args:
        buffer: the bucket's bytes, ``uint8``, contiguous, on any device.
        verify: ``True`` (every byte) or ``"sample"`` (see the module docs).
        key: the sample's seed; sender and receiver pass the same (e.g.
            :func:`sample_key` of the version and bucket index).
        slots: ``(offset, nbytes)`` of each tensor in the bucket, bytes.

    Raises:
        ValueError: ``verify`` is False (nothing to digest).
    """
    if verify is False:
        raise ValueError("bucket_digest() needs verify=True or 'sample'")
    flat = buffer.reshape(-1)
    seed = flat.numel()
    if verify is True:
        return slots_digest(flat, slots or [(0, seed)])
    # A bucket of at most SAMPLE_BYTES samples every byte (one per stride): its digest
    # is the whole buffer's, without drawing and gathering the positions (~30x dearer).
    if seed > SAMPLE_BYTES:
        return _signed(
            xxhash.xxh3_64_intdigest(_take(flat, _positions(seed, key, slots)).data, seed=seed)
        )
    host = flat.detach().cpu().contiguous()
    return _signed(xxhash.xxh3_64_intdigest(host.numpy().data, seed=seed))


def views_digest(
    views: Sequence[torch.Tensor],
    verify: Verify,
    *,
    key: int = 0,
    offsets: Sequence[int] | None = None,
) -> int:
    """:func:`bucket_digest` of a bucket that was never packed (the IPC transport's
    direct mode), over the tensors' own bytes.

    ``"sample"`` lays the views end to end (a packed bucket without padding and its
    tensors digest alike); ``True`` places view ``i`` at byte ``offsets[i]`` of the
    bucket (default: end to end, each rounded up to 8 bytes), so that the views digest
    as the bucket packed at those offsets.

    Args:
        views: each tensor's bytes, ``uint8``, 1-D, contiguous, in slot order.
        verify: ``True`` or ``"sample"``.
        key: the sample's seed.
        offsets: ``True`` only: each view's byte offset in the bucket (multiples of 8:
            a plan's slot offsets).

    Raises:
        ValueError: ``verify`` is False.
    """
    if verify is False:
        raise ValueError("views_digest() needs verify=True or 'sample'")
    sizes = [int(v.numel()) for v in views]
    if verify is True:
        if offsets is None:
            ends = [0]
            for size in sizes:
                ends.append(ends[-1] + -(-size // 8) * 8)
            offsets = ends[:-1]
        digest = BlockDigest()
        for view, offset in zip(views, offsets, strict=True):
            digest.add(offset, view.detach())
        return digest.value()
    total = sum(sizes)
    hasher = xxhash.xxh3_64(seed=total)
    if total <= SAMPLE_BYTES:  # every byte (see bucket_digest)
        for view in views:
            if view.numel():
                hasher.update(view.detach().cpu().contiguous().numpy().data)
        return _signed(hasher.intdigest())
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    positions = _positions(total, key, list(zip(offsets, sizes, strict=False)))
    # positions is sorted: each view's share of it is one run, cut at the offsets.
    cuts = np.searchsorted(positions, offsets).tolist()
    for view, offset, lo, hi in zip(views, offsets, cuts, cuts[1:], strict=False):
        if hi > lo:
            hasher.update(_take(view, positions[lo:hi] - offset).data)
    return _signed(hasher.intdigest())


def slots_digest(buffer: torch.Tensor, slots: Sequence[tuple[int, int]]) -> int:
    """``verify=True``'s digest of a packed bucket: :class:`~aiosync._digest.BlockDigest`
    of each slot's ``(offset, nbytes)`` bytes of ``uint8`` ``buffer`` (any device; the
    padding between slots is not read)."""
    digest = BlockDigest()
    for offset, nbytes in slots:
        digest.add(offset, buffer[offset : offset + nbytes])
    return digest.value()


def _take(view: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    """The bytes of ``uint8`` ``view`` at ``positions``, on the host (indexed through
    numpy where ``view`` is there: a fraction of torch's per-call cost)."""
    if view.is_cuda:
        return view[torch.from_numpy(positions).to(view.device)].cpu().numpy()
    return view.detach().numpy()[positions]


def _signed(value: int) -> int:
    """An unsigned 64-bit digest as the int64 with the same bits."""
    return value - _INT64 if value >= _INT64 // 2 else value


def sample_key(version: int, bucket: int) -> int:
    """The seed of the sample of ``bucket`` in the sync of ``version``: a fresh
    sample every sync, so that a fault that stays put is met by a later one."""
    return (version * 1_000_003 + bucket) % (1 << 63)


# -- the test fault: one byte flipped in transit ------------------------------------

# bucket index → (byte offset, XOR mask), armed in a receiving process by a test.
_ARMED: dict[int, tuple[int, int]] = {}


def arm_transit_fault(bucket: int, byte: int, mask: int = 0xFF) -> None:
    """Test hook: XOR byte ``byte`` of bucket ``bucket`` with ``mask`` (default 0xFF:
    every bit; ``0x40`` of a bf16's high byte: its exponent's top bit, ~0.01 becomes
    ~1e36) the next time this process receives it, before its copy and its check: a
    transport fault on the receive path. One-shot.

    Raises:
        ValueError: ``mask`` is not 1 to 255.
    """
    if not 0 < int(mask) < 256:
        raise ValueError(f"mask must flip 1 to 8 bits of a byte (1..255), got {mask}")
    _ARMED[int(bucket)] = (int(byte), int(mask))


def transit_fault_armed(bucket: int) -> bool:
    """Whether a test armed a transit fault for ``bucket`` in this process."""
    return bucket in _ARMED


def disarm_transit_faults() -> None:
    """Test hook: drop every armed, not yet applied transit fault of this process."""
    _ARMED.clear()


def transit_fault(buffer: torch.Tensor, bucket: int) -> None:
    """Apply the fault armed for ``bucket`` to its received ``uint8`` bytes (a no-op
    unless a test armed one)."""
    armed = _ARMED.pop(bucket, None)
    if armed is not None:
        byte, mask = armed
        flat = buffer.reshape(-1)
        flat[byte] = flat[byte] ^ mask
