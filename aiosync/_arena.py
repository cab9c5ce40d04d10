"""Trainer memory another process can map: arenas of shared memory.

:func:`aiosync.refit.share_parameters` re-homes a module's tensors into one
:class:`Arena`; a colocated transport then sends the engine the arena's handle and each
tensor's byte offset instead of packing it (the IPC transport's direct mode), and the
engine's workers copy straight out of the trainer's own memory.

* CPU: a named POSIX shared-memory segment, opened by name.
* CUDA: one allocation CUDA IPC can share (``expandable_segments`` off for it,
  ``aiosync/_cuda_ipc.py``), named once by :func:`~aiosync._cuda_ipc.share_fields`: a
  receiver maps it once and keeps the mapping while the arena is used.

CPU names are ``aiosync-params-<pid>-<16 hex>`` in ``/dev/shm``: the creator unlinks the
name on :meth:`Arena.close` and at interpreter exit; a SIGKILLed creator's names are
removed by the next aiosync process's sweep (``transports/_leftovers.py``).
Unlinking only forbids new mappings: the tensors stay valid while referenced.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import threading
from typing import Any

import torch

from aiosync._cuda_ipc import ipc_shareable_allocations, share_fields

__all__ = ["ARENA_NAME_RE", "Arena", "locate", "posix_shm"]

#: What an arena's name looks like (a receiver maps no other name).
ARENA_NAME_RE = re.compile(r"^aiosync-params-[1-9][0-9]*-[0-9a-f]{16}$")

_lock = threading.Lock()
# Open arenas of this process: (device, first address, end address) → arena.
_open: dict[tuple[torch.device, int, int], Arena] = {}


def posix_shm() -> Any:
    """Python's own binding of ``shm_open``/``shm_unlink`` (what
    ``multiprocessing.shared_memory`` uses); called directly it keeps clear of the
    resource tracker, which would unlink a segment when a process that merely
    opened it exits."""
    import _posixshmem

    return _posixshmem


class Arena:
    """``nbytes`` bytes of shared memory on ``device``; :attr:`tensor` is ``uint8[nbytes]``.

    Attributes:
        name: ``aiosync-params-<pid>-<16 hex>``; on CPU the segment's name in ``/dev/shm``.
        fields: on CUDA, the memory's :func:`~aiosync._cuda_ipc.share_fields` (None on CPU).

    Raises (at construction):
        ValueError: ``nbytes`` is not positive, or ``device`` is neither CPU nor CUDA.
        OSError: the CPU segment cannot be created (``/dev/shm`` full).
        TransportError: CUDA memory that cannot be shared (``expandable_segments`` on
            and this torch cannot switch it off).
    """

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.device = torch.device(device)
        self.name = f"aiosync-params-{os.getpid()}-{secrets.token_hex(8)}"
        self.nbytes = nbytes
        self.fields: dict[str, Any] | None = None
        self._mmap: mmap.mmap | None = None
        if self.device.type == "cuda":
            with ipc_shareable_allocations():
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.fields = share_fields(self.tensor)
            # No name to unlink: the memory lives while the tensors use it.
            self._unlinked = False
        elif self.device.type == "cpu":
            posix = posix_shm()
            fd = posix.shm_open("/" + self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            try:
                os.ftruncate(fd, nbytes)
                self._mmap = mmap.mmap(fd, nbytes)
            except BaseException:
                posix.shm_unlink("/" + self.name)
                raise
            finally:
                os.close(fd)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self._unlinked = False
        else:
            raise ValueError(f"arenas live on cpu or cuda, not {self.device}")
        self.device = self.tensor.device  # with its index: what locate() compares
        start = self.tensor.data_ptr()
        self._span = (self.device, start, start + nbytes)
        with _lock:
            _open[self._span] = self

    def close(self) -> None:
        """Send no more refs of it; unlink the CPU name (no new mapping). The memory lives
        while tensors use it. Idempotent."""
        with _lock:
            _open.pop(self._span, None)
            if self._unlinked:
                return
            self._unlinked = True
        if self.device.type == "cpu":
            with contextlib.suppress(FileNotFoundError):
                posix_shm().shm_unlink("/" + self.name)

    @property
    def closed(self) -> bool:
        return self._unlinked


def locate(tensor: torch.Tensor) -> tuple[Arena, int] | None:
    """``(arena, byte offset)`` of a contiguous, non-empty ``tensor`` whose bytes lie in an
    open arena of this process on its device; None otherwise (another tensor is packed)."""
    if not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        for (device, first, last), arena in _open.items():
            if first <= start and end <= last and device == tensor.device:
                return arena, start - first
    return None


@atexit.register
def _unlink_all() -> None:
    for arena in list(_open.values()):
        arena.close()
