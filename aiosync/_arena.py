"""Trainer memory another process can map by name: named POSIX shared-memory arenas.

:func:`aiosync.refit.share_parameters` re-homes a module's tensors into one
:class:`Arena`; a colocated transport then sends the engine ``(arena name, byte
offset)`` of each tensor instead of packing it (the IPC transport's direct mode), and
the engine's workers copy straight out of the trainer's own memory.

Names are ``aiosync-params-<pid>-<16 hex>`` in ``/dev/shm``: the creator unlinks the
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

__all__ = ["ARENA_NAME_RE", "Arena", "locate", "posix_shm"]

#: What an arena's name looks like (a receiver maps no other name).
ARENA_NAME_RE = re.compile(r"^aiosync-params-[1-9][0-9]*-[0-9a-f]{16}$")

_lock = threading.Lock()
# Open arenas of this process: (first address, end address) → arena.
_open: dict[tuple[int, int], Arena] = {}


def posix_shm() -> Any:
    """Python's own binding of ``shm_open``/``shm_unlink`` (what
    ``multiprocessing.shared_memory`` uses); called directly it keeps clear of the
    resource tracker, which would unlink a segment when a process that merely
    opened it exits."""
    import _posixshmem

    return _posixshmem


class Arena:
    """``nbytes`` bytes of named shared memory, mapped here; :attr:`tensor` is ``uint8[nbytes]``.

    Raises (at construction):
        ValueError: ``nbytes`` is not positive.
        OSError: the segment cannot be created (``/dev/shm`` full).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        posix = posix_shm()
        self.name = f"aiosync-params-{os.getpid()}-{secrets.token_hex(8)}"
        self.nbytes = nbytes
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
        start = self.tensor.data_ptr()
        self._span = (start, start + nbytes)
        self._unlinked = False
        with _lock:
            _open[self._span] = self

    def close(self) -> None:
        """Unlink the name (no new mapping; the memory lives while tensors use it). Idempotent."""
        with _lock:
            _open.pop(self._span, None)
            if self._unlinked:
                return
            self._unlinked = True
        with contextlib.suppress(FileNotFoundError):
            posix_shm().shm_unlink("/" + self.name)

    @property
    def closed(self) -> bool:
        return self._unlinked


def locate(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """``(arena name, arena nbytes, byte offset)`` of a contiguous CPU ``tensor`` whose
    bytes lie in an open arena of this process; None otherwise (another tensor is packed)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        for (first, last), arena in _open.items():
            if first <= start and end <= last:
                return arena.name, arena.nbytes, start - first
    return None


@atexit.register
def _unlink_all() -> None:
    for arena in list(_open.values()):
        arena.close()
