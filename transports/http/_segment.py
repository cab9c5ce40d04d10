"""The memory behind one posted bucket, owned by the transport and released on every path.

On CPU a bucket lives in a named file in ``/dev/shm`` (POSIX shared memory)
that this process creates, maps with ``torch.from_file`` (``MAP_SHARED``) and
unlinks in :meth:`FlatBuffer.release`. The server maps the same file read-only
by name (``torch.from_file(path, False, numel, dtype=...)``), so no byte is
copied, and nothing else is involved: no ``torch_shm_manager`` daemon, no
process-wide sharing strategy, no reference count that only the receiver can
drop. That last point is what makes a failed or cancelled post safe: torch's
``file_system`` strategy adds a reference per pickled handle and only a
receiver that decodes it removes it, so an undecoded payload pinned its
segment for the life of the process (case C15). Here the sender unlinks the
file as soon as the server answered or the post was abandoned; a server that
mapped it keeps its mapping (the memory is freed when both sides unmapped), a
server that had not opened it yet gets "no such file" and loads nothing.

On CUDA the buffer is an ordinary device tensor, shared by CUDA-IPC handle
(torch's reductions); :meth:`FlatBuffer.release` drops this side's reference.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import weakref

import torch

from .._cuda_ipc import ipc_shareable_allocations

__all__ = ["SEGMENT_DIR", "FlatBuffer", "is_segment_path", "own_segments"]

#: Where POSIX shared memory lives on Linux; the payload names a file here.
SEGMENT_DIR = "/dev/shm"
_PREFIX = "aiosync-http-"
# What a segment we create looks like. A decoder maps nothing else, so a forged
# payload cannot make a server map an arbitrary file.
_PATH_RE = re.compile(r"^/dev/shm/aiosync-http-[0-9]+-[0-9a-f]{16}$")


def is_segment_path(path: object) -> bool:
    """True if ``path`` names a bucket segment as :class:`FlatBuffer` creates them."""
    return isinstance(path, str) and _PATH_RE.fullmatch(path) is not None


def own_segments(pid: int | None = None) -> list[str]:
    """The bucket segments process ``pid`` (default: this one) created and has not released."""
    prefix = f"{_PREFIX}{os.getpid() if pid is None else pid}-"
    try:
        return sorted(f for f in os.listdir(SEGMENT_DIR) if f.startswith(prefix))
    except FileNotFoundError:
        return []


def _unlink(path: str, owner: int) -> None:
    # A forked child inherits the buffer objects, not the segments' ownership:
    # only the creating process unlinks (e.g. from its exit handlers).
    if os.getpid() != owner:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class FlatBuffer:
    """A bucket's ``[numel]`` tensor of one dtype and, on CPU, the shared file behind it.

    Create with :meth:`allocate`, write through :attr:`tensor`, serialize, and
    call :meth:`release` once the server answered (or the post failed or was
    cancelled). Idempotent; also runs when the buffer is garbage-collected or
    the interpreter exits, so even a path that forgot it leaves no file behind.

    Attributes:
        path: the ``/dev/shm`` file on CPU (None on CUDA, and for zero elements).
        numel: elements.
        dtype: element type.
    """

    def __init__(self, tensor: torch.Tensor, path: str | None) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.path = path
        self.numel = tensor.numel()
        self.dtype = tensor.dtype
        self._finalizer = (
            None if path is None else weakref.finalize(self, _unlink, path, os.getpid())
        )

    @classmethod
    def allocate(cls, numel: int, dtype: torch.dtype, device: torch.device) -> FlatBuffer:
        """An uninitialised buffer of ``numel`` (>= 0) elements of ``dtype`` on ``device``.

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
        path = f"{SEGMENT_DIR}/{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, numel * dtype.itemsize)
            tensor = torch.from_file(path, True, numel, dtype=dtype)
        except BaseException:
            _unlink(path, os.getpid())
            raise
        finally:
            os.close(fd)
        return cls(tensor, path)

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
        """Unlink the shared file (CPU) and drop this side's reference to the memory.

        A server that mapped the file keeps a valid mapping; one that had not
        opened it yet can no longer. The memory is freed once every mapping is
        gone. Idempotent.
        """
        self._tensor = None
        if self._finalizer is not None:
            self._finalizer()
