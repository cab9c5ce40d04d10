"""The memory behind one posted bucket, owned by the transport and released on every path.

On CPU a bucket is a named ``/dev/shm`` file this process creates, maps and
unlinks (:class:`Segment`); the server maps it read-only by name. A
:class:`SegmentPool` keeps the segments of answered posts for the next bucket
and sync; any post not answered empties it, every segment unlinked and never
written again. On CUDA the buffer is a device tensor shared by CUDA-IPC handle.
Why, and what a server that decodes a late payload sees: ``docs/sglang.md``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import weakref

import torch

from aiosync._cuda_ipc import ipc_shareable_allocations

__all__ = [
    "SEGMENT_DIR",
    "FlatBuffer",
    "Segment",
    "SegmentPool",
    "is_segment_path",
    "own_segments",
]

#: Where POSIX shared memory lives on Linux; the payload names a file here.
SEGMENT_DIR = "/dev/shm"
_PREFIX = "aiosync-http-"
# What a segment we create looks like. A decoder maps nothing else, so a forged
# payload cannot make a server map an arbitrary file.
_PATH_RE = re.compile(r"^/dev/shm/aiosync-http-[0-9]+-[0-9a-f]{16}$")


def is_segment_path(path: object) -> bool:
    """True if ``path`` names a bucket segment as :class:`Segment` creates them."""
    return isinstance(path, str) and _PATH_RE.fullmatch(path) is not None


def own_segments(pid: int | None = None) -> list[str]:
    """The bucket segments process ``pid`` (default: this one) created and has not released."""
    prefix = f"{_PREFIX}{os.getpid() if pid is None else pid}-"
    try:
        return sorted(f for f in os.listdir(SEGMENT_DIR) if f.startswith(prefix))
    except FileNotFoundError:
        return []


def _unlink(path: str, owner: int) -> None:
    # A forked child inherits the segment objects, not their ownership: only the
    # creating process unlinks (e.g. from its exit handlers).
    if os.getpid() != owner:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Segment:
    """One ``/dev/shm`` file of ``nbytes`` bytes that this process created and maps shared.

    Create with :meth:`create`; :meth:`view` it as the flat tensor of a bucket;
    :meth:`close` unlinks the file and drops this side's mapping (also when the
    object is garbage-collected or the interpreter exits).

    Attributes:
        path: the file, ``/dev/shm/aiosync-http-<pid>-<16 hex>``.
        nbytes: its size, bytes (> 0).
    """

    def __init__(self, path: str, data: torch.Tensor) -> None:
        self.path = path
        self.nbytes = data.numel()
        self._data: torch.Tensor | None = data
        self._finalizer = weakref.finalize(self, _unlink, path, os.getpid())

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment of ``nbytes`` (> 0) bytes, mapped read-write (pages not yet touched).

        Raises:
            ValueError: ``nbytes`` is not positive (a 0-byte mapping is an error).
            OSError: the file cannot be created (``/dev/shm`` full or missing).
        """
        if nbytes <= 0:
            raise ValueError(f"a segment needs > 0 bytes, got {nbytes}")
        path = f"{SEGMENT_DIR}/{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            data = torch.from_file(path, True, nbytes, dtype=torch.uint8)
        except BaseException:
            _unlink(path, os.getpid())
            raise
        finally:
            os.close(fd)
        return cls(path, data)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._data is None

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of ``dtype`` of the segment, as a ``[numel]`` tensor.

        Raises:
            ValueError: closed, or ``numel`` elements of ``dtype`` do not fit.
        """
        if self._data is None:
            raise ValueError(f"segment {self.path} was closed")
        nbytes = numel * dtype.itemsize
        if not 0 < nbytes <= self.nbytes:
            raise ValueError(f"{numel} {dtype} ({nbytes} bytes) do not fit {self.nbytes} bytes")
        return self._data[:nbytes].view(dtype)

    def close(self) -> None:
        """Unlink the file and drop this side's mapping. Idempotent.

        A server that mapped the file keeps a valid mapping; one that had not
        opened it yet can no longer. The memory is freed once every mapping
        (and every tensor viewing it) is gone.
        """
        self._data = None
        self._finalizer()


class FlatBuffer:
    """A bucket's ``[numel]`` tensor of one dtype and, on CPU, the segment behind it.

    Create with :meth:`allocate` (its own segment, unlinked by :meth:`release`)
    or take one from a :class:`SegmentPool` (a view of a pooled segment, which
    the pool keeps or unlinks); write through :attr:`tensor`, serialize, and
    call :meth:`release` once the server answered (or the post failed or was
    cancelled). Idempotent; an own segment is also unlinked when the buffer is
    garbage-collected or the interpreter exits, so even a path that forgot it
    leaves no file behind.

    Attributes:
        segment: the shared file on CPU (None on CUDA, and for zero elements).
        owned: whether :meth:`release` closes ``segment`` (False for a pool's).
        numel: elements.
        dtype: element type.
    """

    def __init__(
        self, tensor: torch.Tensor, segment: Segment | None, *, owned: bool = True
    ) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.segment = segment
        self.owned = owned
        self.numel = tensor.numel()
        self.dtype = tensor.dtype

    @property
    def path(self) -> str | None:
        """The ``/dev/shm`` file the payload names (None on CUDA and for zero elements)."""
        return None if self.segment is None else self.segment.path

    @classmethod
    def allocate(cls, numel: int, dtype: torch.dtype, device: torch.device) -> FlatBuffer:
        """An uninitialised buffer of ``numel`` (>= 0) elements of ``dtype`` on ``device``.

        On CPU it has a segment of its own, exactly ``numel`` elements long.

        Raises:
            ValueError: ``numel`` is negative.
            OSError: the shared-memory file cannot be created (``/dev/shm`` full
                or missing).
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if device.type != "cpu":
            # Sent as a CUDA-IPC handle: memory IPC can share (C20).
            with ipc_shareable_allocations():
                return cls(torch.empty(numel, dtype=dtype, device=device), None)
        if numel == 0:
            # A 0-byte mapping is an error: nothing to share, the payload says "empty".
            return cls(torch.empty(0, dtype=dtype), None)
        segment = Segment.create(numel * dtype.itemsize)
        return cls(segment.view(numel, dtype), segment)

    @property
    def tensor(self) -> torch.Tensor:
        """The flat tensor (pack into it, serialize it).

        Raises:
            ValueError: the buffer was released.
        """
        if self._tensor is None:
            raise ValueError("the bucket buffer was released")
        return self._tensor

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._tensor is None

    def release(self) -> None:
        """Drop this side's reference to the memory; an own segment is unlinked too.

        A server that mapped the file keeps a valid mapping; one that had not
        opened it yet can no longer (own segment). Idempotent.
        """
        self._tensor = None
        if self.owned and self.segment is not None:
            self.segment.close()


class SegmentPool:
    """CPU segments kept mapped between buckets and between syncs.

    :meth:`take` hands out a buffer for a bucket: a view of the smallest free
    pooled segment it fits, or of a new segment of ``max(bucket bytes,
    segment_bytes)`` when none fits (a bucket of zero bytes needs none).
    :meth:`recycle` takes a buffer back once every server *answered* for it;
    :meth:`clear` unlinks every segment, for any post that was not answered and
    at shutdown. A segment is created only when every pooled one is in use or
    too small, and a sync holds at most two buffers at once (it packs one bucket
    while the servers load the previous one), so a pool holds two segments of
    ``segment_bytes`` plus, where the plan has a tensor larger than a bucket,
    one or two of that size: what it keeps in ``/dev/shm`` between syncs.

    Args:
        segment_bytes: the smallest segment created, bytes (> 0): the plan's
            usual bucket size, so that every ordinary bucket fits every segment.

    Raises:
        ValueError: ``segment_bytes`` is not positive.
    """

    def __init__(self, segment_bytes: int) -> None:
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
        self.segment_bytes = segment_bytes
        self._free: list[Segment] = []
        self._all: list[Segment] = []

    @property
    def paths(self) -> list[str]:
        """The pooled segments' files, in creation order (free or handed out)."""
        return [segment.path for segment in self._all]

    def take(self, numel: int, dtype: torch.dtype) -> FlatBuffer:
        """An uninitialised CPU buffer of ``numel`` (>= 0) elements of ``dtype``.

        Raises:
            ValueError: ``numel`` is negative.
            OSError: a new shared-memory file cannot be created (``/dev/shm`` full).
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return FlatBuffer.allocate(0, dtype, torch.device("cpu"))
        fitting = [segment for segment in self._free if segment.nbytes >= nbytes]
        if fitting:
            segment = min(fitting, key=lambda s: s.nbytes)
            self._free.remove(segment)
        else:
            segment = Segment.create(max(nbytes, self.segment_bytes))
            self._all.append(segment)
        return FlatBuffer(segment.view(numel, dtype), segment, owned=False)

    def recycle(self, flat: FlatBuffer) -> None:
        """Release ``flat``, whose post every server answered: its pooled segment is
        free again (unless :meth:`clear` unlinked it meanwhile); a buffer not from
        this pool is just released."""
        segment = flat.segment
        flat.release()
        if (
            segment is not None
            and not segment.closed
            and any(segment is s for s in self._all)
            and not any(segment is s for s in self._free)
        ):
            self._free.append(segment)

    def clear(self) -> None:
        """Unlink and forget every pooled segment (views handed out stay readable here
        but are never recycled). Idempotent."""
        segments, self._all, self._free = self._all, [], []
        for segment in segments:
            segment.close()
