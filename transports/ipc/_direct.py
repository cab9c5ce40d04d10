"""Direct mode: a bucket whose tensors live in the trainer's shared memory is not packed.

A trainer whose parameters :func:`aiosync.refit.share_parameters` re-homed into an arena
(``aiosync/_arena.py``: named shared memory on CPU, one CUDA-IPC-shareable allocation on
a GPU) yields them as views of that arena. For a bucket whose every tensor is such a
view (contiguous, as the manifest says: ``group_by_bucket`` checked shape and dtype, on
the synchronizer's device), the trainer sends, instead of a packed buffer's handle, each
tensor's place (:func:`direct_refs`):

* CPU: ``[arena name, arena nbytes, byte offset]``;
* CUDA: ``[arena fields, byte offset]``, the fields
  :func:`~aiosync._cuda_ipc.share_fields` took once when the arena was made (so the
  handle is the same every sync, and the worker's mapping of it is reused).

The worker maps the arena (once: kept between syncs while it is used) and
``load_weights`` copies from the trainer's own memory into the engine's weights
(:func:`direct_views`). One copy instead of two. Any other bucket (a cast, a gathered
DTensor, a non-contiguous view, a tensor outside an arena or re-assigned out of it, a
delta's wire tensors) is packed as before.

The trainer's tensors must not change until every worker has loaded the bucket: a sync
holds the source lock, which :meth:`~aiosync.WeightSynchronizer.policy_update` takes for
the optimizer's step; a step taken beside a sync (after a bare ``mark_stale()``) would be
read half-way, in direct mode as in packing. On CUDA the trainer synchronizes its
stream before it sends refs (what the last step queued is written), and a worker before
its reply (its copy out of the trainer's memory is done).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from aiosync._arena import ARENA_NAME_RE, locate
from aiosync.errors import TransportError

from ..packing import Bucket, dtype_from_name

__all__ = ["DirectRef", "direct_refs", "direct_views"]

#: A tensor's place: ``[name, nbytes, offset]`` (CPU) or ``[fields, offset]`` (CUDA);
#: None for an empty one.
DirectRef = list[Any] | None


def direct_refs(
    group: Sequence[tuple[str, torch.Tensor]], device: torch.device
) -> list[DirectRef] | None:
    """Each tensor's place in an arena of this process on ``device``, in slot order;
    None unless every non-empty tensor of the bucket lies in one (it is then packed)."""
    refs: list[DirectRef] = []
    for _name, tensor in group:
        if tensor.numel() == 0:
            refs.append(None)
            continue
        where = locate(tensor)
        if where is None or where[0].device != device:
            return None
        arena, offset = where
        if arena.fields is not None:
            refs.append([arena.fields, offset])
        else:
            refs.append([arena.name, arena.nbytes, offset])
    return refs if any(ref is not None for ref in refs) else None


def direct_views(
    refs: object, bucket: Bucket, mapped: Callable[[Mapping[str, Any]], torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of the trainer's arenas: ``(hf_name, tensor)`` in
    slot order. ``mapped(handle)`` is the worker's ``uint8`` mapping of the arena an
    :func:`~aiosync.transports.ipc._shm.open_handle` handle names (``{"kind": "shm",
    "name", "nbytes"}`` or a CUDA arena's fields).

    Raises:
        TransportError: malformed refs, a name that is not an arena's, or a tensor
            outside its arena.
    """
    if not isinstance(refs, list) or len(refs) != len(bucket.slots):
        raise TransportError(f"malformed direct refs for bucket {bucket.index}")
    out: list[tuple[str, torch.Tensor]] = []
    for slot, ref in zip(bucket.slots, refs, strict=True):
        dtype = dtype_from_name(slot.dtype)
        if ref is None:
            if slot.nbytes != 0:
                raise TransportError(f"direct bucket {bucket.index}: {slot.name!r} has no ref")
            out.append((slot.name, torch.empty(slot.shape, dtype=dtype)))
            continue
        try:
            if isinstance(ref[0], Mapping):
                handle, offset = dict(ref[0]), int(ref[1])
                valid = handle.get("kind") == "cuda" and len(ref) == 2
            else:
                name, nbytes, offset = str(ref[0]), int(ref[1]), int(ref[2])
                handle = {"kind": "shm", "name": name, "nbytes": nbytes}
                valid = bool(ARENA_NAME_RE.match(name)) and len(ref) == 3
            size = int(handle["nbytes"])
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed direct ref {ref!r}: {exc!r}") from exc
        if not valid or not 0 <= offset <= size - slot.nbytes:
            raise TransportError(f"refusing direct ref {ref!r} for {slot.name!r}")
        raw = mapped(handle)[offset : offset + slot.nbytes]
        out.append((slot.name, raw.view(dtype).view(slot.shape)))
    return out
