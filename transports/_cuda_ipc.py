"""CUDA memory that another process can map, whatever the caching allocator's settings.

With ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``)
torch's caching allocator maps memory with the CUDA virtual-memory API, whose
blocks ``cudaIpcGetMemHandle`` cannot share (case C20). Staging buffers that
travel as CUDA-IPC handles (the IPC transport's buckets, the HTTP transport's
payloads) are allocated inside :func:`ipc_shareable_allocations`, which switches
the setting off for that allocation and back on after it, as verl and NeMo-RL do.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import torch

from aiosync.errors import TransportError

__all__ = ["allocator_settings", "ipc_shareable_allocations"]

_EXPANDABLE = re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE)


def allocator_settings() -> str:
    """The caching allocator's settings string (``"expandable_segments:True,..."``)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return str(getter())
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


@contextlib.contextmanager
def ipc_shareable_allocations() -> Iterator[None]:
    """Allocate, inside this block, memory that CUDA IPC can share (see the module docs).

    A no-op unless ``expandable_segments`` is on; then it is off inside the block
    and on again after it, even when the block raises.

    Raises:
        TransportError: ``expandable_segments`` is on and this torch cannot
            switch it off (no ``torch._C._accelerator_setAllocatorSettings``).
    """
    if not _EXPANDABLE.search(allocator_settings()):
        yield
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        raise TransportError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, whose memory CUDA IPC "
            "cannot share, and this torch cannot switch it off for the staging buffers: "
            "unset it for the trainer, or use a torch with "
            "torch._C._accelerator_setAllocatorSettings"
        )
    setter("expandable_segments:False")
    try:
        yield
    finally:
        setter("expandable_segments:True")
