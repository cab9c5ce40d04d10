"""Delta refits: move only the elements whose bits changed since the last committed version.

Between two optimizer steps at RL learning rates only a few percent of bf16 weights
change bit-wise. The trainer keeps a :class:`DeltaBaseline`, the bits of the last
version committed on every worker, and sends, per tensor, a :class:`WeightPatch` in
whichever encoding is smallest for that tensor and that sync:

============  ==========================================  =============================
encoding      wire tensors                                bytes (``n`` elements, ``k``
                                                          changed, ``s`` bytes each)
============  ==========================================  =============================
``dense``     the tensor                                  ``n * s``
``indices``   ``int32[k]`` flat indices, ``values[k]``    ``k * (4 + s)``
``bitmap``    ``uint8[ceil(n / 8)]`` changed bits,        ``ceil(n / 8) + k * s``
              ``values[k]``
============  ==========================================  =============================

A tensor with no changed bit is not sent at all. Indices are flat, row-major, in the
FULL checkpoint tensor's coordinates (vLLM's ``SparseWeightPatch`` convention), so a
receiver holding a tensor-parallel slice applies the part of a patch that falls in
its :class:`~aiosync.layout.Part` (:func:`apply_patch`), never rebuilding the full
tensor. "Changed" is bitwise (``-0.0`` vs ``0.0`` and NaN payloads count), so the
receiver's weights end up bit-identical to the trainer's.

Transactional: a patch names the version it was computed against (``base``); the
baseline advances only when a sync committed on every worker (:meth:`DeltaBaseline.commit`),
and anything else (:meth:`DeltaBaseline.invalidate`) makes the next sync a full one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from aiosync.errors import RefitMismatchError
from aiosync.layout import Part

__all__ = [
    "DeltaBaseline",
    "Encoding",
    "PatchModel",
    "StagedPatchModel",
    "WeightPatch",
    "apply_patch",
    "patch_from_wire",
    "patch_to_wire",
]

Encoding = Literal["dense", "indices", "bitmap"]

#: Integer dtype of each element size, for comparing and moving bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Bit ``j`` of a bitmap byte is element ``8 * i + j`` (little-endian within a byte).
_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@runtime_checkable
class PatchModel(Protocol):
    """An engine worker's model that writes delta patches into its live weights (the
    embedded engine's runner); a transport refuses a delta to a model without it."""

    def apply_weight_patches(self, patches: Any) -> int:
        """Write each :class:`WeightPatch` into the part held (checked first); returns
        the elements written."""
        ...


@runtime_checkable
class StagedPatchModel(PatchModel, Protocol):
    """A :class:`PatchModel` whose patches land in a host copy of the weights first
    (a vLLM worker: its layers are rebuilt by vLLM's reload, never written in place).
    Receivers call :meth:`finish_weight_patches` after a sync's last patch and before
    they vote, so that a failure there fails the sync on every rank."""

    def finish_weight_patches(self) -> None:
        """Make every patch applied since the last call live in the engine's weights."""
        ...


def finish_patches(model: PatchModel) -> None:
    """:meth:`StagedPatchModel.finish_weight_patches` where ``model`` stages them."""
    if isinstance(model, StagedPatchModel):
        model.finish_weight_patches()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s raw bits, flat, as the integer dtype of its element size."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_BITS[flat.element_size()])


# On CPU the scans over every element (compare, find, pack) go through numpy, zero-copy:
# its single-threaded kernels are 2-20x torch's for these (a refit runs beside training,
# usually on one core): `np.flatnonzero` 26 ms against `nonzero`'s 71 ms on 56 M
# elements at 1.5 % changed, `np.packbits` 6 ms against 120 ms. Other devices use torch.


def _changed(old_bits: torch.Tensor, new_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(changed, flat)``: ``bool[n]`` where the bits differ and ``int64[k]`` its
    positions, ascending."""
    if old_bits.device.type == "cpu":
        changed = np.not_equal(old_bits.numpy(), new_bits.numpy())
        return torch.from_numpy(changed), torch.from_numpy(np.flatnonzero(changed))
    mask = new_bits != old_bits
    return mask, mask.nonzero().view(-1)


def pack_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """``bool[n]`` → ``uint8[ceil(n / 8)]`` (element ``8i + j`` is bit ``j`` of byte ``i``)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = -mask.numel() % 8
    padded = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    return (padded.view(-1, 8).to(torch.uint8) * _WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_bitmap(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of :func:`pack_bitmap`: ``bool[numel]``."""
    if bitmap.device.type == "cpu":
        unpacked = np.unpackbits(bitmap.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(unpacked.view(np.bool_))
    bits = (bitmap.view(-1, 1) & _WEIGHTS.to(bitmap.device)) != 0
    return bits.view(-1)[:numel]


@dataclass(frozen=True, slots=True)
class WeightPatch:
    """What changed in one checkpoint tensor since version ``base``.

    Attributes:
        name: HF checkpoint name.
        base: the weight version the patch was computed against; applied to any
            other version it would corrupt the weights.
        shape: the FULL tensor's shape.
        encoding: see the module table.
        values: ``dense``: the whole tensor (``shape``); else ``[k]`` new values, in
            flat index order, in the tensor's dtype.
        where: ``indices``: ``int32[k]`` (``int64`` past 2**31 elements) flat
            indices, ascending; ``bitmap``: ``uint8[ceil(numel / 8)]``; ``dense``:
            None.
        flat: ``int64[k]`` flat indices where the encoder already has them (the
            trainer's own patches, for :meth:`DeltaBaseline.commit`); never sent.
    """

    name: str
    base: int
    shape: tuple[int, ...]
    encoding: Encoding
    values: torch.Tensor
    where: torch.Tensor | None = None
    flat: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (values and index/bitmap)."""
        n = self.values.numel() * self.values.element_size()
        if self.where is not None:
            n += self.where.numel() * self.where.element_size()
        return n

    def flat_indices(self) -> torch.Tensor:
        """``int64[k]`` flat indices of the changed elements (not for ``dense``)."""
        if self.flat is not None:
            return self.flat
        if self.encoding == "indices":
            assert self.where is not None
            return self.where.to(torch.int64)
        assert self.encoding == "bitmap" and self.where is not None
        numel = 1
        for n in self.shape:
            numel *= n
        if self.where.device.type == "cpu":
            bits = np.unpackbits(self.where.numpy(), count=numel, bitorder="little")
            return torch.from_numpy(np.flatnonzero(bits))
        return unpack_bitmap(self.where, numel).nonzero().view(-1)


def encode_patch(
    name: str, base: int, old_bits: torch.Tensor, new: torch.Tensor
) -> WeightPatch | None:
    """The smallest patch taking ``old_bits`` (:func:`_bits` of the base) to ``new``;
    None when no bit changed.

    Raises:
        RefitMismatchError: ``new`` has another element count or size than the base.
    """
    # The baseline lives in host memory: compare there (a GPU tensor is copied once).
    new = new.detach().to(old_bits.device)
    new_bits = _bits(new)
    if new_bits.shape != old_bits.shape or new_bits.dtype != old_bits.dtype:
        raise RefitMismatchError(
            f"{name}: {tuple(new.shape)} {new.dtype} differs from its baseline's layout"
        )
    # One pass finds the changed elements: their count, their values and the indices
    # encoding all come from it (a bool ``sum()`` or mask indexing would each cost
    # another pass over the tensor, several times the compare's on CPU).
    changed, flat = _changed(old_bits, new_bits)
    k = flat.numel()
    if k == 0:
        return None
    n, size = new_bits.numel(), new.element_size()
    index_size = 4 if n < 2**31 else 8
    costs: dict[Encoding, int] = {
        "dense": n * size,
        "indices": k * (index_size + size),
        "bitmap": -(-n // 8) + k * size,
    }
    encoding = min(costs, key=lambda e: (costs[e], e != "dense"))
    shape = tuple(new.shape)
    if encoding == "dense":
        return WeightPatch(name, base, shape, "dense", new)
    values = new.reshape(-1)[flat]
    if encoding == "indices":
        where = flat.to(torch.int32) if index_size == 4 else flat
    else:
        where = pack_bitmap(changed)
    return WeightPatch(name, base, shape, encoding, values, where, flat)


def apply_patch(target: torch.Tensor, held: Part, patch: WeightPatch) -> int:
    """Write ``patch`` into ``target``, the live tensor holding ``held`` of the full one.

    Only the changed elements inside ``held`` are written (a tensor-parallel slice
    takes its share of a patch in full-tensor coordinates); nothing is gathered.

    Returns:
        Elements written.

    Raises:
        RefitMismatchError: the patch's shape is not ``held.shape``, its dtype is
            not the target's, or ``target`` is not a contiguous ``held.local_shape``
            tensor (all checked before writing).
    """
    if tuple(patch.shape) != tuple(held.shape):
        raise RefitMismatchError(f"{patch.name}: patch of {patch.shape}, model holds {held}")
    if patch.values.dtype != target.dtype:
        raise RefitMismatchError(f"{patch.name}: patch {patch.values.dtype}, model {target.dtype}")
    if tuple(target.shape) != held.local_shape or not target.is_contiguous():
        raise RefitMismatchError(
            f"{patch.name}: the model's tensor {tuple(target.shape)} is not a contiguous "
            f"{held.local_shape} (its held part)"
        )
    with torch.no_grad():
        if patch.encoding == "dense":
            source = patch.values.to(target.device)
            if not held.is_whole:
                source = source.narrow(held.dim, held.start, held.length)
            target.copy_(source)
            return target.numel()
        flat = patch.flat_indices().to(target.device)
        values = patch.values.to(target.device)
        if not held.is_whole:
            # Row-major: index = outer * (n_dim * inner) + c * inner + rest.
            inner = 1
            for n in held.shape[held.dim + 1 :]:
                inner *= n
            span = held.shape[held.dim] * inner
            coord = (flat % span) // inner
            keep = (coord >= held.start) & (coord < held.start + held.length)
            flat, values, coord = flat[keep], values[keep], coord[keep]
            flat = (
                (flat // span) * (held.length * inner)
                + (coord - held.start) * inner
                + (flat % inner)
            )
        target.view(-1)[flat] = values
        return int(flat.numel())


class DeltaBaseline:
    """The trainer's bits of the last version committed on every worker (host memory).

    Costs one copy of the model's bytes in host memory, plus, during a full sync, a
    second (the staged next baseline) until it commits; during a delta sync only the
    patches. :meth:`stage` / :meth:`stage_full` record what a sync sends,
    :meth:`commit` advances the baseline once that sync committed everywhere, and
    :meth:`invalidate` (any failure, cancellation, respawn, discarded weights)
    makes the next sync a full one.

    Attributes:
        version: the version the baseline holds; None: none (the next sync is full).
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self._bits: dict[str, torch.Tensor] = {}
        self._staged: tuple[int, dict[str, torch.Tensor] | None, list[WeightPatch]] | None = None

    def invalidate(self) -> None:
        """Forget the baseline: the next sync is a full one."""
        self.version, self._bits, self._staged = None, {}, None

    def diff(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightPatch]:
        """Patches from the baseline to ``weights`` (every baseline name, in order);
        unchanged tensors yield nothing.

        Raises:
            RefitMismatchError: no baseline, or ``weights`` names another set of tensors.
        """
        if self.version is None:
            raise RefitMismatchError("no committed baseline: the next sync must be full")
        seen = 0
        for name, tensor in weights:
            old = self._bits.get(name)
            if old is None:
                raise RefitMismatchError(f"{name!r} is not in the delta baseline")
            seen += 1
            patch = encode_patch(name, self.version, old, tensor)
            if patch is not None:
                yield patch
        if seen != len(self._bits):
            raise RefitMismatchError(
                f"the trainer yielded {seen} of the baseline's {len(self._bits)} tensors"
            )

    def stage_full(
        self, version: int, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A full sync of ``version`` sends ``weights``: yields them on, copying each
        one's bits (host memory) as it passes, for :meth:`commit`."""
        staged: dict[str, torch.Tensor] = {}
        self._staged = (version, staged, [])
        for name, tensor in weights:
            staged[name] = _bits(tensor).to("cpu", copy=True)
            yield name, tensor

    def stage(self, version: int, patches: list[WeightPatch]) -> None:
        """A delta sync of ``version`` is sending ``patches`` (against :attr:`version`)."""
        self._staged = (version, None, patches)

    def commit(self) -> None:
        """The staged sync committed on every worker: the baseline becomes its version
        (a delta's patches are applied to the baseline as the workers applied them)."""
        if self._staged is None:
            return
        version, full, patches = self._staged
        self._staged = None
        if full is not None:
            self._bits = full
        for patch in patches:
            old = self._bits[patch.name]
            if patch.encoding == "dense":
                old.copy_(_bits(patch.values).cpu())
            else:
                old[patch.flat_indices().cpu()] = _bits(patch.values).cpu()
        self.version = version


# -- wire ------------------------------------------------------------------------


def patch_to_wire(patch: WeightPatch) -> tuple[list[object], list[tuple[str, torch.Tensor]]]:
    """``(meta, tensors)``: JSON-safe ``[name, base, shape, encoding, k]`` (``k``:
    values sent) and the wire tensors (``name`` dense, or ``name@where`` then
    ``name@values``)."""
    meta: list[object] = [
        patch.name, patch.base, list(patch.shape), patch.encoding, patch.values.numel()
    ]  # fmt: skip
    if patch.where is None:
        return meta, [(patch.name, patch.values)]
    return meta, [(f"{patch.name}@where", patch.where), (f"{patch.name}@values", patch.values)]


def wire_manifest(
    metas: Iterable[list[object]],
    manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The wire tensors' ``{name: (shape, dtype)}`` of patches described by ``metas``
    (each ``[name, base, shape, encoding, k]``), against the full ``manifest``."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, _base, shape, encoding, k in metas:
        assert isinstance(name, str) and isinstance(k, int)
        full_shape, dtype = manifest[name]
        if tuple(shape) != tuple(full_shape):  # type: ignore[arg-type]
            raise RefitMismatchError(f"{name}: patch of {shape}, manifest {full_shape}")
        numel = 1
        for n in full_shape:
            numel *= n
        if encoding == "dense":
            out[name] = (full_shape, dtype)
            continue
        if encoding == "indices":
            out[f"{name}@where"] = ((k,), torch.int32 if numel < 2**31 else torch.int64)
        elif encoding == "bitmap":
            out[f"{name}@where"] = ((-(-numel // 8),), torch.uint8)
        else:
            raise RefitMismatchError(f"{name}: unknown patch encoding {encoding!r}")
        out[f"{name}@values"] = ((k,), dtype)
    return out


def patch_from_wire(meta: list[object], tensors: Mapping[str, torch.Tensor]) -> WeightPatch:
    """The inverse of :func:`patch_to_wire` (``tensors`` by wire name)."""
    name, base, shape, encoding = meta[:4]
    assert isinstance(name, str) and isinstance(base, int) and isinstance(shape, list)
    if encoding == "dense":
        return WeightPatch(name, base, tuple(shape), "dense", tensors[name])
    assert encoding in ("indices", "bitmap")
    return WeightPatch(
        name, base, tuple(shape), encoding, tensors[f"{name}@values"], tensors[f"{name}@where"]
    )
