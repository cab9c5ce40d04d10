"""``share_parameters``: a module's weights in shared memory, for one-copy refits.

A colocated IPC refit normally copies every byte twice: the trainer packs it into a
shared bucket, the engine copies it out. When the trainer's own tensors live in memory
the engine can map (named shared memory on CPU, one CUDA-IPC-shareable allocation on a
GPU) the engine copies straight out of it, and the refit is one copy (the IPC
transport's direct mode, on by default: ``IPCWeightSynchronizer(direct=True)``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from aiosync._arena import Arena

__all__ = ["SharedParameters", "share_parameters"]

#: Each tensor starts on a multiple of this many bytes (cache lines; every dtype's alignment).
_ALIGN = 64


class SharedParameters:
    """The arena holding a module's parameters and persistent buffers (see
    :func:`share_parameters`). A context manager; :meth:`close` unlinks the arena's
    name (the tensors stay valid and the module trains on; later refits pack them)."""

    def __init__(self, arena: Arena, tensors: int) -> None:
        self.arena = arena
        #: How many tensors were re-homed.
        self.tensors = tensors

    @property
    def name(self) -> str:
        """The arena's name; on CPU the shared-memory segment's (``/dev/shm/<name>``)."""
        return self.arena.name

    @property
    def nbytes(self) -> int:
        """The arena's size, bytes (the tensors' bytes plus alignment)."""
        return self.arena.nbytes

    def close(self) -> None:
        """Stop sending refs of the arena (later refits pack its tensors); on CPU unlink
        the segment's name. Idempotent; also done at interpreter exit."""
        self.arena.close()

    def __enter__(self) -> SharedParameters:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _tensors(module: nn.Module, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Each distinct parameter (and persistent buffer), once, with a name for messages."""
    seen: set[int] = set()
    items: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    if buffers:
        for prefix, sub in module.named_modules():
            for name, buf in sub._buffers.items():
                if buf is not None and name not in sub._non_persistent_buffers_set:
                    items.append((f"{prefix}.{name}" if prefix else name, buf))
    for name, tensor in items:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def share_parameters(module: nn.Module, *, buffers: bool = True) -> SharedParameters:
    """Move ``module``'s parameters (and persistent buffers) into one shared-memory arena,
    in place: each keeps its ``Parameter`` object (``p.data`` is re-pointed), so an
    optimizer built before or after is unaffected, and tied parameters stay tied.

    On CPU the arena is a named POSIX shared-memory segment; on CUDA one allocation that
    CUDA IPC can share (made with ``expandable_segments`` off, whatever the trainer's
    setting), which needs the module's bytes once more while the tensors move.
    Call it once, after the module is on its device in its training dtype and before the
    first sync; what the optimizer allocates (its states) stays private. A view or a
    ``.data`` alias of a parameter taken before the call (an object that cached
    ``p.detach()``) keeps the old memory and no longer sees the training: take such views
    after it (the embedded engine's ``HFModelRunner`` looks its tensors up again). Each
    tensor gets a place of its own: a buffer that was a view of a parameter no longer
    is; tied parameters (one ``Parameter`` object) stay tied.
    Direct mode relies on the sync reading the tensors while no optimizer step runs:
    take the steps inside :meth:`~aiosync.WeightSynchronizer.policy_update` (a sync
    waits for it, and it for a sync), never beside a sync after a bare ``mark_stale()``.

    Args:
        module: a module whose tensors are dense tensors on one device, CPU or one GPU
            (not DTensors: a sharded trainer's gathered tensors are fresh allocations,
            packed as usual).
        buffers: also move persistent buffers (those a checkpoint holds).

    Returns:
        The arena (:class:`SharedParameters`): ``close()`` it (or use ``with``) when the
        trainer is done; a CPU name is also unlinked at exit, and the next aiosync process
        sweeps it after a SIGKILL (CUDA memory dies with the process).

    Raises:
        TypeError: ``module`` is not a module; a tensor is a DTensor or sparse, is on
            neither CPU nor CUDA, or the tensors are on more than one device.
        ValueError: the module has no tensors to share.
        OSError: ``/dev/shm`` cannot hold the arena.
        TransportError: CUDA memory cannot be made shareable (``expandable_segments``
            on, and this torch cannot switch it off for the arena).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"share_parameters needs a torch.nn.Module, got {type(module).__name__}")
    tensors = list(_tensors(module, buffers))
    offsets: list[int] = []
    total = 0
    for name, tensor in tensors:
        if hasattr(tensor, "placements"):
            raise TypeError(f"share_parameters needs dense tensors: {name!r} is a DTensor")
        if tensor.layout != torch.strided:
            raise TypeError(f"share_parameters needs dense tensors: {name!r} is {tensor.layout}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise TypeError(
                f"share_parameters needs CPU or CUDA tensors: {name!r} is on {tensor.device}"
            )
        if tensor.device != tensors[0][1].device:
            raise TypeError(
                f"share_parameters needs the tensors on one device: {name!r} is on "
                f"{tensor.device}, {tensors[0][0]!r} on {tensors[0][1].device}"
            )
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += tensor.numel() * tensor.element_size()
    if not tensors:
        raise ValueError("the module has no parameters or persistent buffers to share")
    arena = Arena(max(total, 1), tensors[0][1].device)
    try:
        with torch.no_grad():
            for (_name, tensor), offset in zip(tensors, offsets, strict=True):
                nbytes = tensor.numel() * tensor.element_size()
                home = arena.tensor[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
                home.copy_(tensor)
                tensor.data = home
    except BaseException:
        arena.close()
        raise
    return SharedParameters(arena, len(tensors))
