"""Digests of tensor bytes, the same on the trainer and on every worker.

:func:`tensor_digest` (SHA-256) is what ``verify_engine()`` compares;
:class:`BlockDigest` is ``verify=True``'s per-bucket digest, cheap enough to run on
every sync (``docs/reliability.md``, "Verified refits").
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

__all__ = ["BLOCK_BYTES", "CHUNK_BYTES", "BlockDigest", "tensor_digest"]


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 (hex) of ``tensor``'s raw bytes, row-major (what a worker holds must
    hash as what the trainer sent, bit for bit; vLLM's ``/weight_checker`` also
    hashes with SHA-256)."""
    raw = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(raw.numpy().data).hexdigest()


# -- the block-sum digest of ``verify=True``: every byte, any single flipped bit --------

#: A block of the block-sum digest, bytes: one page. Pieces are cut at these
#: boundaries and at every tensor slot's ends.
BLOCK_BYTES = 4096
_BLOCK_WORDS = BLOCK_BYTES // 8
#: The step in which a packer copies and digests a bucket, bytes (a multiple of
#: :data:`BLOCK_BYTES`, cut in bucket coordinates): small enough that a chunk just
#: copied is still in the core's L2 cache when it is summed.
CHUNK_BYTES = 256 * 1024

_MASK = (1 << 64) - 1
#: The weight step from one block to the next (a block at byte ``a`` weighs ``a / 4 + 1``).
_STRIDE = BLOCK_BYTES // 4


class BlockDigest:
    """The block-sum digest of a bucket, accumulated piece by piece, on any device.

    A bucket's tensor slots are cut into pieces at every multiple of
    :data:`BLOCK_BYTES` (4096) of the bucket's offsets; a piece starting at byte ``a``
    (a multiple of 8) has the odd weight ``a / 4 + 1`` and the sum ``S`` of its
    little-endian 64-bit words (a slot's last word zero-padded; the bytes between
    slots are not read). The digest is ``sum(weight * S)`` modulo ``2**64``, as a
    signed int64.

    What it catches, for certain: any change confined to one 64-bit word (a flipped
    bit, several flipped bits of one word, a corrupted byte): ``weight * d`` is never
    ``0`` modulo ``2**64`` for an odd weight and ``d != 0``. Anything else (a zeroed,
    stale or truncated tensor; tensors swapped or shifted; pages swapped) changes it
    unless the weighted sums cancel exactly, e.g. two flips of one bit position
    (``0 -> 1`` and ``1 -> 0``) in one piece, or words reordered inside one piece.

    It is one read of the bytes, plain integer sums: numpy's in host memory, where a
    chunk just copied is summed while it is in cache (:func:`~aiosync.transports.
    packing.pack`), torch's wrapping ``int64`` sums as CUDA kernels on a GPU (no host
    copy); both give the same value. Linear: pieces may be added in any order.

    Contract of :meth:`add`: a call may start or end inside a block only at a slot's
    start or end (whole slots, or chunks cut at multiples of :data:`BLOCK_BYTES`).

    Attributes:
        pieces: the :meth:`add` calls so far (a zero-byte piece counts).
    """

    def __init__(self) -> None:
        self._acc = 0
        # Added on a GPU: each run's sums (int64, on the device) and (first weight, count).
        self._device_sums: list[torch.Tensor] = []
        self._device_weights: list[tuple[int, int]] = []
        # Host whole blocks: each one's sum at its block index, weighed once in value().
        self._sums = np.zeros(0, dtype=np.int64)
        self.pieces = 0

    def add(self, offset: int, raw: torch.Tensor) -> None:
        """Add the bytes ``raw`` (``uint8``, 1-D, contiguous, any device), which lie at
        byte ``offset`` of the bucket. Pieces must not overlap (see the class docs).

        Raises:
            ValueError: ``offset`` is not a multiple of 8, or ``raw`` is not a 1-D
                contiguous ``uint8`` tensor.
        """
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise ValueError(
                f"BlockDigest.add needs 1-D contiguous uint8 bytes, got {raw.dtype} "
                f"{tuple(raw.shape)}"
            )
        if raw.is_cuda:
            self._check(offset)
            self._add_device_bytes(offset, raw.detach())
        else:
            self.add_host(offset, raw.detach().numpy())

    def add_host(self, offset: int, raw: np.ndarray) -> None:
        """:meth:`add` of host bytes given as a 1-D ``uint8`` numpy array: the packer's
        path, one numpy call per chunk of whole blocks (torch's per-call cost would be
        a good part of a 256 KiB chunk's).

        Raises:
            ValueError: ``offset`` is not a multiple of 8.
        """
        self._check(offset)
        n = raw.size
        if n == 0:
            return
        if not (offset | n) % BLOCK_BYTES and n <= CHUNK_BYTES:
            # A packer's chunk of whole blocks (the common case): one numpy call.
            first, count = offset // BLOCK_BYTES, n // BLOCK_BYTES
            if self._sums.size < first + count:
                self._grow(first + count)
            words = raw.view(np.int64).reshape(count, _BLOCK_WORDS)
            np.add.reduce(words, axis=1, out=self._sums[first : first + count])
            return
        head = min(n, -offset % BLOCK_BYTES)
        if head:  # a slot's start inside a block (or all of a slot within one)
            self._acc += (offset // 4 + 1) * _host_sum(raw[:head])
            offset, raw, n = offset + head, raw[head:], n - head
        whole = n - n % BLOCK_BYTES
        if whole:
            first, count = offset // BLOCK_BYTES, whole // BLOCK_BYTES
            if self._sums.size < first + count:
                self._grow(first + count)
            out = self._sums[first : first + count]
            words = raw[:whole].view(np.int64)
            if count <= _NUMPY_BLOCKS:
                np.add.reduce(words.reshape(count, _BLOCK_WORDS), axis=1, out=out)
            else:
                # Out of cache torch's row sums are faster than numpy's (~11 against ~8 GB/s).
                if words.ctypes.data % 8:
                    words = words.copy()
                rows = torch.from_numpy(words).view(count, _BLOCK_WORDS)
                torch.sum(rows, dim=1, out=torch.from_numpy(out))
        if whole < n:  # a slot's end inside a block
            self._acc += ((offset + whole) // 4 + 1) * _host_sum(raw[whole:])

    def _grow(self, blocks: int) -> None:
        """Room for the sums of ``blocks`` blocks (at least; doubling)."""
        grown = np.zeros(max(blocks, 2 * self._sums.size), dtype=np.int64)
        grown[: self._sums.size] = self._sums
        self._sums = grown

    def _check(self, offset: int) -> None:
        self.pieces += 1
        if offset % 8:
            raise ValueError(f"BlockDigest: a piece must start at a multiple of 8, got {offset}")

    def _add_device_bytes(self, offset: int, raw: torch.Tensor) -> None:
        """:meth:`add` on a GPU: one row-sum kernel per run of whole blocks, one sum per
        partial block, their results kept on the device and weighed in :meth:`value`
        (kernel launches, not bytes, are a small tensor's cost there)."""
        n = raw.numel()
        if n == 0:
            return
        head = min(n, -offset % BLOCK_BYTES)
        if head:
            self._device_sums.append(_device_sum(raw[:head]).view(1))
            self._device_weights.append((offset // 4 + 1, 1))
            offset, raw, n = offset + head, raw[head:], n - head
        whole = n - n % BLOCK_BYTES
        if whole:
            count = whole // BLOCK_BYTES
            self._device_sums.append(_device_words(raw[:whole]).view(count, _BLOCK_WORDS).sum(1))
            self._device_weights.append((offset // 4 + 1, count))
        if whole < n:
            self._device_sums.append(_device_sum(raw[whole:]).view(1))
            self._device_weights.append(((offset + whole) // 4 + 1, 1))

    def value(self) -> int:
        """The digest so far, a signed int64 (synchronizes with a CUDA device)."""
        total = self._acc
        blocks = self._sums.size
        if blocks:
            # sum_b (STRIDE b + 1) S_b; a block no piece covered holds 0.
            weighted = int(np.dot(self._sums, _index(blocks)))
            total += _STRIDE * weighted + int(np.add.reduce(self._sums))
        if self._device_sums:
            # One weighing for every piece added on the device: block j of a run
            # starting at weight w weighs w + STRIDE j (built on the host, one copy in).
            sums = torch.cat(self._device_sums)
            weights = np.concatenate(
                [
                    base + _STRIDE * np.arange(count, dtype=np.int64)
                    for base, count in self._device_weights
                ]
            )
            on_device = torch.from_numpy(weights).to(sums.device)
            total += int((sums * on_device).sum())
        total &= _MASK
        return total - (1 << 64) if total >> 63 else total


#: Up to this many blocks (256 KiB: a packer's chunk, in cache) numpy sums the rows.
_NUMPY_BLOCKS = CHUNK_BYTES // BLOCK_BYTES


def _host_sum(raw: np.ndarray) -> int:
    """The sum of ``raw``'s words (fewer than a block of bytes; a length that is not a
    multiple of 8 ends a slot, its last word zero-padded), modulo ``2**64``."""
    if raw.size % 8:
        padded = np.zeros(-(-raw.size // 8) * 8, dtype=np.uint8)
        padded[: raw.size] = raw
        raw = padded
    return int(np.add.reduce(raw.view(np.int64)))


def _device_words(raw: torch.Tensor) -> torch.Tensor:
    """``raw``'s bytes (a multiple of 8) as int64 words, copied where they do not start
    on an 8-byte boundary in memory."""
    if raw.data_ptr() % 8:
        raw = raw.clone()
    return raw.view(torch.int64)


def _device_sum(raw: torch.Tensor) -> torch.Tensor:
    """:func:`_host_sum` on the device, a 0-d int64 tensor."""
    if raw.numel() % 8:
        padded = torch.zeros(-(-raw.numel() // 8) * 8, dtype=torch.uint8, device=raw.device)
        padded[: raw.numel()] = raw
        raw = padded
    return _device_words(raw).sum()


_INDEX = np.arange(1024, dtype=np.int64)


def _index(count: int) -> np.ndarray:
    """``int64[count]`` ``0, 1, ...`` (cached, grown to the largest bucket seen)."""
    global _INDEX
    if _INDEX.size < count:
        _INDEX = np.arange(max(count, 2 * _INDEX.size), dtype=np.int64)
    return _INDEX[:count]
