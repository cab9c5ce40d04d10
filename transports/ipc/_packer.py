"""What the IPC sender reads and packs: its staging buffers, the source's buckets, digests.

:func:`_stage` makes the sender's private directory and its ping-pong buffers;
:class:`_Packer` reads each bucket's tensors from the source and packs them into a
buffer (digested as :class:`_Check` says), or, for a bucket whose tensors the
workers can map where they lie, takes their references instead (direct, nothing
copied: :mod:`._direct`). The sender (:mod:`._sender`) decides which buffer and when.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from aiosync._digest import BlockDigest
from aiosync.errors import RefitMismatchError

from .._leftovers import dir_prefix, sweep_leftovers
from .._verify import Verify, bucket_digest, sample_key, views_digest
from ..packing import Bucket, BucketPlan, TensorSlot, in_place, pack, slot_view
from ._direct import DirectRef, direct_refs
from ._shm import SharedBuffer


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


class _DirectBucket(NamedTuple):
    """A bucket sent direct: where its tensors lie, its digest (None: not checked),
    and when reading it from the source started and ended (``time.monotonic()``)."""

    refs: list[DirectRef]
    digest: int | None
    read_start: float
    read_end: float


class _Packer:
    """Reads buckets from the source on ``device`` and packs them (blocking: called in a
    worker thread, or on the event loop for a small inline refit)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The slots and buffer of the bucket the source is reading (see destination).
        self._into: tuple[dict[str, TensorSlot], torch.Tensor] | None = None

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

    def read_direct(
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
                    _, digest = self.read_and_pack(groups, group, spare, False, row, bucket, check)
                    return run, None, (digest,)
                return run, group, None
            if self.device.type == "cuda":
                # What the last optimizer step queued on the stream is written before
                # a worker reads the trainer's memory.
                torch.cuda.current_stream(self.device).synchronize()
            digest = None if check.verify is False else check.views_digest(bucket, group)
            run.append(_DirectBucket(refs, digest, start, time.monotonic()))
        return run, None, None

    def read_and_pack(
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
            self.pack(bucket, group, buffer, blocks)
            if blocks is not None:
                digest = blocks.value()
            elif check is not None:
                digest = check.digest(bucket, buffer.tensor)
        if last:
            _exhaust(groups)
        _stamp(row, "pack_end")
        return (group if buffer is None else None), digest

    def pack(
        self,
        bucket: Bucket,
        group: list[tuple[str, torch.Tensor]],
        buffer: SharedBuffer,
        digest: BlockDigest | None = None,
    ) -> None:
        """Pack ``group`` into ``buffer`` as ``bucket`` lays it out (digested into
        ``digest`` chunk by chunk when given); on CUDA, wait until it is written."""
        pack(bucket, group, out=buffer.tensor, digest=digest)
        if buffer.tensor.is_cuda:
            torch.cuda.current_stream(buffer.tensor.device).synchronize()


def _stamp(row: dict[str, Any] | None, key: str) -> None:
    """Record ``time.monotonic()`` (seconds) as ``row[key]`` when tracing."""
    if row is not None:
        row[key] = time.monotonic()


def _exhaust(groups: Iterator[Any]) -> None:
    for _ in groups:
        raise RefitMismatchError("the source yielded more buckets than the plan holds")
