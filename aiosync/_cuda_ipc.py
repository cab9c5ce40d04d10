"""CUDA memory that another process can map, whatever the caching allocator's settings.

With ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``)
torch's caching allocator maps memory with the CUDA virtual-memory API, whose
blocks ``cudaIpcGetMemHandle`` cannot share (case C20). Staging buffers that
travel as CUDA-IPC handles (the IPC transport's buckets, the HTTP transport's
payloads, a CUDA trainer's parameter arena) are allocated inside
:func:`ipc_shareable_allocations`, which switches the setting off for that allocation
and back on after it, as verl and NeMo-RL do; :func:`share_fields` names such memory
for another process.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from aiosync.errors import TransportError

__all__ = ["allocator_settings", "ipc_shareable_allocations", "share_fields"]

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


def share_fields(tensor: torch.Tensor) -> dict[str, Any]:
    """msgpack-safe fields naming ``tensor``'s whole storage for another process:
    ``{"kind": "cuda", "nbytes", "device_uuid", "handle", "size_bytes", "offset_bytes",
    "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required"}``,
    the fields of ``UntypedStorage._share_cuda_()`` (the CUDA IPC memory handle of the
    caching allocator's block and torch's cross-process reference counter, as
    ``torch.multiprocessing.reductions`` uses them) plus the device's UUID, so that a
    receiver with another ``CUDA_VISIBLE_DEVICES`` finds the same GPU. ``nbytes`` is the
    storage's size. Call it once per storage: each call wraps the storage in another
    reference-counting context.

    Raises:
        TransportError: the storage cannot be shared (memory of ``expandable_segments``).
    """
    storage = tensor.untyped_storage()
    try:
        (
            _device_index,
            handle,
            size_bytes,
            offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = storage._share_cuda_()
    except RuntimeError as exc:
        raise TransportError(
            f"CUDA IPC cannot share {storage.nbytes()} bytes on {tensor.device} (allocator "
            f"settings: {allocator_settings()!r}; expandable_segments memory is not "
            f"shareable): {exc}"
        ) from exc
    return {
        "kind": "cuda",
        "nbytes": int(storage.nbytes()),
        "device_uuid": str(torch.cuda.get_device_properties(tensor.device).uuid),
        "handle": bytes(handle),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle) if event_handle else b"",
        "event_sync_required": bool(event_sync_required),
    }
