"""Direct mode: a bucket whose tensors live in the trainer's shared memory is not packed.

A CPU trainer whose parameters :func:`aiosync.refit.share_parameters` re-homed into a
named arena (``aiosync/_arena.py``) yields them as views of that arena. For a bucket
whose every tensor is such a view (contiguous, as the manifest says: ``group_by_bucket``
checked shape and dtype), the trainer sends, instead of a packed buffer's handle, each
tensor's ``[arena name, arena nbytes, byte offset]`` (:func:`direct_refs`); the worker maps
the arena (once: kept between syncs while it is used) and ``load_weights`` copies from the
trainer's own memory into the engine's weights (:func:`direct_views`). One copy instead of
two. Any other bucket (a cast, a gathered DTensor, a non-contiguous view, a tensor outside
an arena, a delta's wire tensors) is packed as before.

The trainer's tensors must not change until every worker acknowledged the bucket: a sync
holds the source lock, which :meth:`~aiosync.WeightSynchronizer.policy_update` takes for
the optimizer's step; a step taken beside a sync (after a bare ``mark_stale()``) would be
read half-way, in direct mode as in packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiosync._arena import ARENA_NAME_RE, locate
from aiosync.errors import TransportError

from ..packing import Bucket, dtype_from_name

__all__ = ["DirectRef", "direct_refs", "direct_views"]

#: ``[arena name, arena nbytes, byte offset]`` of one tensor; None for an empty one.
DirectRef = list[Any] | None


def direct_refs(group: Sequence[tuple[str, torch.Tensor]]) -> list[DirectRef] | None:
    """Each tensor's place in an arena of this process, in slot order; None unless every
    non-empty tensor of the bucket lies in one (the bucket is then packed)."""
    refs: list[DirectRef] = []
    for _name, tensor in group:
        if tensor.numel() == 0:
            refs.append(None)
            continue
        where = locate(tensor)
        if where is None:
            return None
        refs.append(list(where))
    return refs if any(ref is not None for ref in refs) else None


def direct_views(
    refs: object, bucket: Bucket, mapped: Callable[[str, int], torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of the trainer's arenas: ``(hf_name, tensor)`` in
    slot order. ``mapped(name, nbytes)`` is the worker's ``uint8`` mapping of an arena.

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
            name, nbytes, offset = str(ref[0]), int(ref[1]), int(ref[2])
        except (IndexError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed direct ref {ref!r}: {exc!r}") from exc
        if not ARENA_NAME_RE.match(name) or not 0 <= offset <= nbytes - slot.nbytes:
            raise TransportError(f"refusing direct ref {ref!r} for {slot.name!r}")
        raw = mapped(name, nbytes)[offset : offset + slot.nbytes]
        out.append((slot.name, raw.view(dtype).view(slot.shape)))
    return out
