"""What each trainer rank holds of the HF checkpoint: source layouts and local tensors.

Three trainers are described here as one :data:`aiosync.layout.Layout` per rank:

* an FSDP2 / DTensor module (:func:`dtensor_layouts`): each ``Shard(d)`` parameter
  is the rank's ``torch.chunk`` cut along ``d`` (FSDP2: dim 0; the last chunks
  may be shorter or empty), a ``Replicate`` one is whole, under the HF checkpoint
  names that :class:`aiosync.refit.DTensorRefitSource` streams;
* a full model held on one rank only (:func:`single_rank_layouts`);
* a plain module replicated on every rank (:func:`replicated_layouts`).

:func:`local_tensor_fn` gives a sender's ``name -> local tensor`` (the DTensor's
``to_local()``, in the manifest dtype, contiguous), what
:func:`aiosync.transports.sharded.run_plan` reads.

The DTensor functions reuse :class:`~aiosync.refit.DTensorRefitSource`'s own
module-to-checkpoint mapping (its entries and conversion), so the names never
drift from those of ``iter_weights``. Nothing here gathers or communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from aiosync.errors import RefitMismatchError
from aiosync.layout import Layout, Part, even_chunks

if TYPE_CHECKING:
    from aiosync.refit.torch_source import DTensorRefitSource

__all__ = [
    "dtensor_layout",
    "dtensor_layouts",
    "iter_local_tensors",
    "local_tensor_fn",
    "manifest_dtypes",
    "replicated_layouts",
    "shard_refusal",
    "single_rank_layouts",
]

#: ``{hf_name: (shape, dtype)}``, as ``RefitSource.prepare_refit_info()`` returns it.
Manifest = Mapping[str, tuple[Sequence[int], torch.dtype]]


def manifest_dtypes(manifest: Manifest) -> dict[str, torch.dtype]:
    """``{hf_name: dtype}`` of a manifest: the ``dtypes`` argument of ``make_plan``."""
    return {name: dtype for name, (_, dtype) in manifest.items()}


def single_rank_layouts(manifest: Manifest, world_size: int, holder: int = 0) -> list[Layout]:
    """Layouts of a trainer whose full model lives on rank ``holder`` only.

    Returns:
        ``world_size`` layouts: rank ``holder`` holds every tensor whole, the
        others hold nothing (empty layouts).

    Raises:
        ValueError: ``holder`` is not in ``range(world_size)``.
    """
    if not 0 <= holder < world_size:
        raise ValueError(f"holder {holder} is not a rank of a world of {world_size}")
    full = {name: Part.whole(shape) for name, (shape, _) in manifest.items()}
    return [full if rank == holder else {} for rank in range(world_size)]


def replicated_layouts(manifest: Manifest, world_size: int) -> list[Layout]:
    """Layouts of a plain module replicated on every rank (DDP): every tensor whole everywhere."""
    full = {name: Part.whole(shape) for name, (shape, _) in manifest.items()}
    return [dict(full) for _ in range(world_size)]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def _dtensor_part(name: str, tensor: Any, rank: int) -> Part | None:
    """The part of ``tensor`` (a DTensor) that global rank ``rank`` holds; None off its mesh.

    Placements apply left to right over the mesh dims, as DTensor does: a second
    ``Shard`` of the same dim cuts the first one's chunk again (still one range).

    Raises:
        ValueError: a placement that is not one contiguous range (``Partial``,
            FSDP2+TP's ``_StridedShard``, shards of two different dims).
    """
    from torch.distributed.tensor import Shard

    shape = tuple(int(n) for n in tensor.shape)
    mesh = tensor.device_mesh
    where = (mesh.mesh == rank).nonzero()
    if where.numel() == 0:
        return None
    coord = [int(c) for c in where[0].tolist()]
    dim: int | None = None
    start = length = 0
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"{name}: placement {placement} on mesh dim {mesh_dim} is not a contiguous "
                "chunk (only Shard and Replicate placements have a source layout)"
            )
        d = placement.dim % len(shape)
        if dim is None:
            dim, start, length = d, 0, shape[d]
        elif d != dim:
            raise ValueError(f"{name}: sharded along dims {dim} and {d}, which is not one Part")
        offset, length = even_chunks(length, mesh.size(mesh_dim))[coord[mesh_dim]]
        start += offset
    if dim is None:
        return Part.whole(shape)
    return Part(shape, dim, start, length)


def _entries_and_tensors(source: DTensorRefitSource) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(entry, live module tensor)`` for each of the source's checkpoint entries.

    The entries are the source's own mapping from module tensors to HF names
    (wrapper prefixes stripped, ties deduplicated, fused tensors split), read
    through its private ``_entries()`` until it offers a public accessor.
    """
    live = source.model.state_dict(keep_vars=True)
    source.check_ties(live)  # a tie broken since the manifest: refused, as iter_weights does
    for entry in source._entries():
        tensor = live.get(entry.module_key)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{entry.module_key!r} vanished from the model")
        yield entry, tensor


def dtensor_layout(source: DTensorRefitSource, rank: int) -> Layout:
    """What global rank ``rank`` holds of ``source``'s HF checkpoint (no communication).

    A ``Shard(d)`` DTensor parameter (FSDP2's ``Shard(0)``) is ``rank``'s
    ``torch.chunk`` cut along ``d`` (:func:`aiosync.layout.even_chunks`: the last
    chunks may be shorter or empty, and an empty chunk is still listed, with
    length 0); a ``Replicate`` DTensor or a plain tensor (an FSDP2 buffer) is
    whole; a DTensor whose mesh does not hold ``rank`` is absent. Names, shapes
    and the set of tensors are ``source.prepare_refit_info()``'s.

    Args:
        source: the trainer's refit source.
        rank: a global rank of the trainer's default group (its sender index).

    Fused MoE experts (``mlp.experts.gate_up_proj [E, 2*Im, H]``, ``down_proj
    [E, H, Im]``) sharded along the expert dim (FSDP2's ``Shard(0)``) are held
    as whole experts: a rank whose chunk is experts ``[a, b)`` holds
    ``mlp.experts.{e}.*_proj.weight`` whole for ``a <= e < b``, and nothing of
    the others.

    Raises:
        RefitMismatchError: a DTensor whose local chunk is not made of whole HF
            tensors or one part of one (:func:`shard_refusal` names it).
    """
    layout: dict[str, Part] = {}
    for entry, tensor in _entries_and_tensors(source):
        part: Part | None = None
        if _is_dtensor(tensor):
            _check_local(entry, tensor)
            part = _dtensor_part(entry.key, tensor, rank)
            if part is None:
                continue  # off this DTensor's mesh: held elsewhere only
        if part is None or part.is_whole:
            for name, shape, _ in entry.outputs:
                layout[name] = Part.whole(shape)
        elif entry.mode == "plain":
            layout[entry.outputs[0][0]] = part
        else:
            # Whole experts [start, start + length): the names of this rank's rows.
            shapes = {name: shape for name, shape, _ in entry.outputs}
            rows = torch.empty(part.local_shape, device="meta")
            for name, _ in source._convert_chunk(entry, rows, part.start):
                layout[name] = Part.whole(shapes[name])
    return layout


def _local_refusal(entry: Any, tensor: Any) -> str | None:
    """Why a DTensor's local chunk cannot be sent as parts of HF tensors; None if it can.

    A plain tensor cut anywhere is one part of one HF tensor; a fused tensor a
    zero-copy rule splits per expert, cut along the expert dim only, is whole
    experts. Decided from the placements, so every rank decides alike.
    """
    from torch.distributed.tensor import Shard

    names = [n for n, _, _ in entry.outputs][:3]
    if entry.merge is not None:
        return (
            f"{entry.key}: a merged PEFT LoRA weight (becomes {names} through a merge, which "
            "gathers the adapter: a collective)"
        )
    dims = set()
    for placement in tensor.placements:
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            return f"{entry.key}: placement {placement} is not a contiguous chunk"
        dims.add(placement.dim % max(tensor.dim(), 1))
    if not dims or entry.mode == "plain" or (entry.mode == "views" and dims == {0}):
        return None
    return (
        f"{entry.key}: sharded along dim(s) {sorted(dims)}, it becomes {names} in the "
        "checkpoint through a split its shards cannot be cut into (only fused experts cut "
        "along the expert dim are)"
    )


def _check_local(entry: Any, tensor: Any) -> None:
    """Refuse a DTensor whose local chunk is not whole HF tensors or one part of one.

    Raises:
        RefitMismatchError: see :func:`_local_refusal`.
    """
    reason = _local_refusal(entry, tensor)
    if reason is not None:
        raise RefitMismatchError(
            f"the shard-aware transport cannot send {reason}: use the broadcast "
            "(sharded=False), which gathers it"
        )


def shard_refusal(source: Any) -> str | None:
    """Why the shard-aware transport cannot send ``source``'s shards as they are held
    (the first such tensor, named, and the reason), or None when it can.

    What the factory asks before it picks the shard-aware path, and what
    :class:`~aiosync.transports.sharded.ShardedWeightSynchronizer` refuses; the same
    on every rank (placements and the checkpoint mapping only; nothing is gathered).
    None for any source other than a :class:`~aiosync.refit.DTensorRefitSource`
    (its full tensors are sent, from one rank).
    """
    from aiosync.refit.torch_source import DTensorRefitSource

    if not isinstance(source, DTensorRefitSource):
        return None
    for entry, tensor in _entries_and_tensors(source):
        if _is_dtensor(tensor):
            reason = _local_refusal(entry, tensor)
            if reason is not None:
                return reason
    return None


def dtensor_layouts(source: DTensorRefitSource, world_size: int) -> list[Layout]:
    """:func:`dtensor_layout` of every rank ``0..world_size-1``: the plan's ``sources``."""
    return [dtensor_layout(source, rank) for rank in range(world_size)]


def local_tensor_fn(source: DTensorRefitSource) -> Callable[[str], torch.Tensor]:
    """This process's ``hf_name -> local tensor``: what it holds of each name, for a sender.

    The tensor is a DTensor's ``to_local()`` (a plain tensor as it is), cast to
    the manifest dtype, made contiguous; its shape is
    ``dtensor_layout(source, rank)[hf_name].local_shape``. When no cast or copy
    is needed it is a view of the live parameter: send it before the next
    optimizer step. A fused tensor held whole (an unsharded MoE expert block) is
    converted once, when its first name is asked for.

    Raises (from the returned callable):
        KeyError: a name this process does not hold.
        ValueError: see :func:`dtensor_layout`.
    """
    by_name: dict[str, tuple[Any, torch.Tensor]] = {}
    for entry, tensor in _entries_and_tensors(source):
        for name, _, _ in entry.outputs:
            by_name[name] = (entry, tensor)
    converted: dict[str, torch.Tensor] = {}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def local(name: str) -> torch.Tensor:
        if name in converted:
            return converted.pop(name)
        entry, tensor = by_name[name]
        dtype = next(d for n, _, d in entry.outputs if n == name)
        held = tensor.detach()
        part: Part | None = None
        if _is_dtensor(held):
            _check_local(entry, held)
            part = _dtensor_part(entry.key, held, rank)
            held = held.to_local()  # type: ignore[attr-defined]
        if entry.mode == "plain" and entry.merge is None:
            return held.to(dtype).contiguous()
        if part is not None and not part.is_whole:
            # This rank's whole experts of a fused tensor cut along the expert dim.
            outputs = source._convert_chunk(entry, held, part.start)
        else:
            # Held whole: the source's own conversion (a merge, a fused split) applies.
            if entry.merge is not None:
                held = entry.merge.merged(held)
            outputs = source._convert(entry, held)
        for out_name, out in outputs:
            out_dtype = next(d for n, _, d in entry.outputs if n == out_name)
            converted[out_name] = out.to(out_dtype).contiguous()
        return converted.pop(name)

    return local


def iter_local_tensors(source: DTensorRefitSource, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, local tensor)`` for every name ``rank`` (this process) holds, in manifest order.

    Each tensor as :func:`local_tensor_fn` gives it; empty chunks included.
    """
    local = local_tensor_fn(source)
    held = dtensor_layout(source, rank)
    for name in source.prepare_refit_info():
        if name in held:
            yield name, local(name)
