"""Bucketed packing of a refit manifest: the byte layout every transport shares.

A manifest (``{hf_name: (shape, dtype)}``, ordered) is split, in order, into
buckets of at most ``bucket_bytes`` bytes. Each bucket is one flat ``uint8``
buffer; each tensor sits at an offset aligned to :data:`PACK_ALIGNMENT_BYTES`
(512) bytes, so any dtype can be viewed in place. A tensor larger than a
bucket travels alone in its own, larger buffer (a 1.73 GiB embedding against a
1.65 GiB buffer once aborted a refit). Buckets may mix dtypes: the layout is by
bytes. Zero-size tensors (a ``(0, 4)`` parameter) occupy no bytes; a bucket may
then hold zero bytes (always so for a manifest of only zero-size tensors), and
the transports move nothing for it but still deliver its names.

Both sides derive the same :class:`BucketPlan` from the manifest and compare
its :attr:`BucketPlan.digest` before any data moves; :func:`compare_manifests`
names the first differing entries.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aiosync._config import PACK_ALIGNMENT_BYTES
from aiosync._digest import CHUNK_BYTES, BlockDigest
from aiosync.delta import DeltaBaseline, WeightPatch, patch_to_wire, wire_manifest
from aiosync.errors import RefitMismatchError

__all__ = [
    "Bucket",
    "BucketPlan",
    "PatchPlan",
    "TensorSlot",
    "compare_manifests",
    "compare_unordered",
    "dtype_from_name",
    "dtype_name",
    "group_by_bucket",
    "in_place",
    "pack",
    "plan_buckets",
    "plan_patches",
    "slot_view",
    "unpack",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the dtype's name on the wire."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`. Raises :class:`RefitMismatchError` on an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RefitMismatchError(f"unknown dtype {name!r} in refit manifest")
    return dtype


def _align(n: int, alignment: int = PACK_ALIGNMENT_BYTES) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lives in its bucket.

    Attributes:
        name: HF parameter name (from the HF checkpoint).
        shape: tensor shape.
        dtype: dtype name as in :func:`dtype_name` (``"bfloat16"``).
        offset: byte offset in the bucket buffer, a multiple of 512.
        nbytes: bytes the tensor occupies (``numel * element_size``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One packed buffer: ``nbytes`` bytes holding ``slots`` in manifest order."""

    index: int
    slots: tuple[TensorSlot, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """A manifest's bucket layout; identical on both sides for the same inputs.

    Attributes:
        buckets: the buckets, in manifest order.
        bucket_bytes: the size limit they were planned with, in bytes.
        digest: SHA-256 (hex) over names, shapes, dtypes and the layout.
    """

    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    digest: str

    @property
    def total_bytes(self) -> int:
        """Payload bytes of all tensors (without alignment padding)."""
        return sum(slot.nbytes for b in self.buckets for slot in b.slots)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.slots) for b in self.buckets)

    @property
    def max_bucket_nbytes(self) -> int:
        """Size of the largest buffer needed, bytes (0 for an empty plan, or one of
        zero-size tensors only)."""
        return max((b.nbytes for b in self.buckets), default=0)

    def manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The ``{hf_name: (shape, dtype)}`` manifest this plan was built from."""
        return {s.name: (s.shape, dtype_from_name(s.dtype)) for b in self.buckets for s in b.slots}

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe description (for sending the plan to engine workers)."""
        return {
            "bucket_bytes": self.bucket_bytes,
            "manifest": [[s.name, list(s.shape), s.dtype] for b in self.buckets for s in b.slots],
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BucketPlan:
        """Rebuild a plan from :meth:`to_json` output, re-deriving and checking the digest.

        Raises:
            RefitMismatchError: malformed data, or the digest does not match.
        """
        try:
            manifest = {
                str(name): (tuple(int(d) for d in shape), dtype_from_name(str(dtype)))
                for name, shape, dtype in data["manifest"]
            }
            plan = plan_buckets(manifest, int(data["bucket_bytes"]))
            claimed = str(data["digest"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RefitMismatchError(f"malformed bucket plan: {exc!r}") from exc
        if plan.digest != claimed:
            raise RefitMismatchError(
                f"bucket plan digest mismatch: sender {claimed[:16]}, derived {plan.digest[:16]}"
            )
        return plan


def plan_buckets(
    manifest: Mapping[str, tuple[Sequence[int], torch.dtype]], bucket_bytes: int
) -> BucketPlan:
    """Split ``manifest`` into buckets of at most ``bucket_bytes`` bytes, in order.

    Args:
        manifest: ``{hf_name: (shape, dtype)}`` as from ``prepare_refit_info()``.
        bucket_bytes: limit per bucket, bytes (> 0). A tensor larger than this
            gets a bucket of its own, sized to it.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    end = 0
    for name, (shape, dtype) in manifest.items():
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        offset = _align(end) if slots else 0
        if slots and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(slots), end))
            slots, offset = [], 0
        slots.append(TensorSlot(name, shape, dtype_name(dtype), offset, nbytes))
        end = offset + nbytes
    if slots:
        buckets.append(Bucket(len(buckets), tuple(slots), end))
    h = hashlib.sha256()
    h.update(json.dumps(bucket_bytes).encode())
    for b in buckets:
        for s in b.slots:
            h.update(json.dumps([b.index, s.name, s.shape, s.dtype, s.offset]).encode())
    return BucketPlan(tuple(buckets), bucket_bytes, h.hexdigest())


@dataclass(frozen=True, slots=True)
class PatchPlan:
    """A delta sync's wire: the patches from a baseline, as buckets (:func:`plan_patches`).

    Attributes:
        plan: the wire tensors' buckets (the full plan's ``bucket_bytes``).
        tensors: ``(wire name, tensor)`` in ``plan``'s order (:func:`~aiosync.delta.patch_to_wire`).
        patches: the patches, for the baseline's ``stage``.
        spec: the workers' ``delta`` entry: ``{"base", "patches" (metas), "digest"}``.
    """

    plan: BucketPlan
    tensors: list[tuple[str, torch.Tensor]]
    patches: list[WeightPatch]
    spec: dict[str, Any]


def plan_patches(
    baseline: DeltaBaseline, plan: BucketPlan, weights: Iterable[tuple[str, torch.Tensor]]
) -> PatchPlan:
    """The patches from ``baseline`` to ``weights`` and their wire plan (blocking: reads
    and compares every tensor of ``weights``; IPC and the collective send it alike).

    Raises:
        RefitMismatchError: no committed baseline, or ``weights`` names another set.
    """
    base = baseline.version
    patches = list(baseline.diff(weights))
    wires = [patch_to_wire(p) for p in patches]
    metas = [meta for meta, _ in wires]
    wire_plan = plan_buckets(wire_manifest(metas, plan.manifest()), plan.bucket_bytes)
    spec = {"base": base, "patches": metas, "digest": wire_plan.digest}
    return PatchPlan(wire_plan, [t for _, tensors in wires for t in tensors], patches, spec)


def compare_manifests(
    local: Mapping[str, tuple[Sequence[int], torch.dtype]],
    remote: Mapping[str, tuple[Sequence[int], torch.dtype]],
    *,
    local_label: str = "trainer",
    remote_label: str = "engine",
    order: bool = True,
) -> None:
    """Raise :class:`RefitMismatchError` naming the first differences, if any.

    Compares names (both ways), shapes and dtypes, and, with ``order``, the order (a
    transport that routes every tensor by name passes False). Cost is linear in the
    number of tensors (dict lookups, no scans).
    """
    problems: list[str] = []
    only_local = [n for n in local if n not in remote]
    only_remote = [n for n in remote if n not in local]
    if only_local:
        problems.append(
            f"{len(only_local)} name(s) unknown to the {remote_label}, first: {only_local[:3]}"
        )
    if only_remote:
        problems.append(
            f"{len(only_remote)} name(s) missing from the {local_label}, first: {only_remote[:3]}"
        )
    for name, (shape, dtype) in local.items():
        if name not in remote:
            continue
        r_shape, r_dtype = remote[name]
        if tuple(shape) != tuple(r_shape) or dtype != r_dtype:
            problems.append(
                f"{name}: {local_label} {tuple(shape)} {dtype_name(dtype)} vs "
                f"{remote_label} {tuple(r_shape)} {dtype_name(r_dtype)}"
            )
            break
    if not problems and order:
        for i, (a, b) in enumerate(zip(local, remote, strict=True)):
            if a != b:
                problems.append(f"order differs at entry {i}: {a!r} vs {b!r}")
                break
    if problems:
        hints = _mismatch_hints(local, remote, only_local, only_remote, local_label, remote_label)
        raise RefitMismatchError("refit manifest mismatch: " + "; ".join(problems + hints))


def compare_unordered(
    trainer: Mapping[str, tuple[Sequence[int], torch.dtype]],
    engine: Mapping[str, tuple[Sequence[int], torch.dtype]],
) -> None:
    """:func:`compare_manifests` for an engine whose loader takes names in any order
    (SGLang's buckets, a worker's ``load_weights``): the engine's entries are laid out
    in the trainer's order first, so only real differences (names, shapes, dtypes) are
    reported."""
    reordered = {name: engine[name] for name in trainer if name in engine}
    reordered.update((name, spec) for name, spec in engine.items() if name not in trainer)
    compare_manifests(trainer, reordered)


def _mismatch_hints(
    local: Mapping[str, tuple[Sequence[int], torch.dtype]],
    remote: Mapping[str, tuple[Sequence[int], torch.dtype]],
    only_local: list[str],
    only_remote: list[str],
    local_label: str,
    remote_label: str,
) -> list[str]:
    """The fix for the mismatches users hit first: a dtype rule, a name prefix, a tie."""
    hints: list[str] = []
    # Names that differ by exactly one output head: one side ties it to the embedding.
    if not only_remote and (head := _tied_head(only_local)):
        hints.append(
            f"hint: the {local_label} has {head} as a tensor of its own, the {remote_label} "
            "ties it to the input embedding (tie_word_embeddings=True): the tie is broken "
            "(lm_head replaced or re-wrapped after tie_weights(), see "
            "DTensorRefitSource.broken_ties) or the configs disagree. Its values are not "
            "dropped silently: re-tie it (model.tie_weights()) or set "
            "tie_word_embeddings=False on both sides"
        )
    elif not only_local and (head := _tied_head(only_remote)):
        hints.append(
            f"hint: the {remote_label} has {head} of its own, the {local_label} ties it to the "
            "input embedding and sends that once: set tie_word_embeddings the same on both sides"
        )
    for names, other, label in (
        (only_local, remote, local_label),
        (only_remote, local, remote_label),
    ):
        prefix = _common_prefix(names, other)
        if prefix:
            hints.append(
                f"hint: every {label} name differs only by the prefix {prefix!r}; strip it "
                "(DTensorRefitSource(state_dict_adapter=...)) or load the model unwrapped"
            )
    dtypes = {
        (dtype_name(local[n][1]), dtype_name(remote[n][1]))
        for n in local
        if n in remote and tuple(local[n][0]) == tuple(remote[n][0]) and local[n][1] != remote[n][1]
    }
    if len(dtypes) == 1:
        ((mine, theirs),) = dtypes
        hints.append(
            f"hint: every differing tensor is {mine} on the {local_label} and {theirs} on the "
            f"{remote_label}: make them agree, on the trainer with "
            "DTensorRefitSource(model, dtype=torch.<engine dtype>) or with the engine's dtype"
        )
    return hints


def _tied_head(names: list[str]) -> str | None:
    """The output-head name (``lm_head.weight``, any prefix) when it is ``names``' only one."""
    if len(names) == 1 and (names[0] == "lm_head.weight" or names[0].endswith(".lm_head.weight")):
        return names[0]
    return None


def _common_prefix(names: list[str], other: Mapping[str, object]) -> str:
    """The one prefix that, stripped from every name, gives a name of ``other``; else ''."""
    if not names:
        return ""
    first = names[0]
    for cut in range(1, len(first)):
        if first[cut - 1] == "." and first[cut:] in other:
            prefix = first[:cut]
            if all(n.startswith(prefix) and n[cut:] in other for n in names):
                return prefix
            return ""
    return ""


def slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """``slot``'s bytes of a flat ``uint8`` ``buffer`` as a tensor of its shape and dtype."""
    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


def in_place(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``view``'s memory already (a source gathered into the slot):
    same start, dtype, shape and strides, so packing it would copy it onto itself."""
    return (
        tensor.data_ptr() == view.data_ptr()
        and tensor.dtype == view.dtype
        and tensor.shape == view.shape
        and tensor.stride() == view.stride()
        and tensor.device == view.device
    )


def pack(
    bucket: Bucket,
    tensors: Iterable[tuple[str, torch.Tensor]],
    out: torch.Tensor | None = None,
    *,
    digest: BlockDigest | None = None,
) -> torch.Tensor:
    """Copy ``tensors`` (in slot order) into a flat ``uint8`` buffer.

    Args:
        bucket: the layout.
        tensors: ``(hf_name, tensor)`` pairs, exactly the bucket's slots, in order;
            any strides (non-contiguous tensors are copied element-wise).
        out: a ``uint8`` buffer of at least ``bucket.nbytes`` bytes to reuse;
            allocated on the first tensor's device when None.
        digest: when given, every slot's packed bytes are added to it (``verify=True``,
            :class:`~aiosync._digest.BlockDigest`). In host memory a contiguous tensor
            is copied and digested 1 MiB at a time, each chunk while it is still in the
            core's cache: the digest then costs a fraction of a second read.

    Returns:
        ``out[:bucket.nbytes]``. Alignment padding is left as it was; a tensor that
        is its slot of ``out`` already (:func:`in_place`) is not copied.

    Raises:
        RefitMismatchError: a name, shape or dtype differs from the slot.
        ValueError: ``out`` is not a 1-D ``uint8`` buffer of ``bucket.nbytes`` bytes
            (checked before anything is copied).
    """
    if out is not None and (
        out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < bucket.nbytes
    ):
        # Checked first: a short buffer must not take a partial copy.
        raise ValueError(f"out must be a 1-D uint8 buffer of >= {bucket.nbytes} bytes")
    it = iter(tensors)
    for slot in bucket.slots:
        try:
            name, tensor = next(it)
        except StopIteration:
            raise RefitMismatchError(
                f"bucket {bucket.index}: source ended before {slot.name!r}"
            ) from None
        _check_tensor(slot, name, tensor)
        if out is None:
            out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=tensor.device)
        view = slot_view(out, slot)
        if digest is not None:
            _pack_digesting(
                out[slot.offset : slot.offset + slot.nbytes], slot, tensor, view, digest
            )
        elif not in_place(tensor, view):
            view.copy_(tensor)
    extra = next(it, None)
    if extra is not None:
        raise RefitMismatchError(f"bucket {bucket.index}: unexpected extra tensor {extra[0]!r}")
    if out is None:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    return out[: bucket.nbytes]


def _pack_digesting(
    raw: torch.Tensor,
    slot: TensorSlot,
    tensor: torch.Tensor,
    view: torch.Tensor,
    digest: BlockDigest,
) -> None:
    """Copy ``tensor`` into ``view`` (``raw``: its ``uint8`` bytes) and add them to
    ``digest``: in host memory chunk by chunk (cut at multiples of
    :data:`~aiosync._digest.CHUNK_BYTES` of the bucket's offsets), each chunk summed
    while the copy left it in cache; on a GPU the whole slot, then its digest."""
    if raw.is_cuda or tensor.device != raw.device or not tensor.is_contiguous():
        if not in_place(tensor, view):
            view.copy_(tensor)
        digest.add(slot.offset, raw)
        return
    if in_place(tensor, view) or slot.nbytes == 0:
        digest.add(slot.offset, raw)
        return
    # numpy's copy of a host chunk: a plain memcpy, which leaves the chunk in cache.
    source = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    target = raw.numpy()
    start = 0
    while start < slot.nbytes:
        stop = min(
            slot.nbytes,
            (slot.offset + start) // CHUNK_BYTES * CHUNK_BYTES + CHUNK_BYTES - slot.offset,
        )
        chunk = target[start:stop]
        chunk[...] = source[start:stop]
        digest.add_host(slot.offset + start, chunk)
        start = stop


def unpack(
    buffer: torch.Tensor, bucket: Bucket, *, digest: BlockDigest | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, view)`` for each slot: zero-copy views into ``buffer``.

    The views alias ``buffer``: consume (load) them before the buffer is reused.

    Args:
        digest: when given, each slot's bytes are added to it once the consumer asks
            for the next view (or for the end): after a loader that copies each tensor
            as it gets it took them, while they are still in cache. It then holds one
            piece per slot (:attr:`~aiosync._digest.BlockDigest.pieces`) only when the
            consumer read every view.

    Raises:
        RefitMismatchError: the buffer is not ``uint8`` or is smaller than the bucket.
    """
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket.nbytes:
        raise RefitMismatchError(
            f"bucket {bucket.index}: got a {buffer.dtype} buffer of {buffer.numel()} "
            f"elements, need uint8 x {bucket.nbytes}"
        )
    for slot in bucket.slots:
        yield slot.name, slot_view(buffer, slot)
        if digest is not None:
            digest.add(slot.offset, buffer[slot.offset : slot.offset + slot.nbytes])


def _check_tensor(slot: TensorSlot, name: str, tensor: torch.Tensor) -> None:
    if name != slot.name:
        raise RefitMismatchError(f"expected {slot.name!r} next, the source yielded {name!r}")
    if tuple(tensor.shape) != slot.shape or dtype_name(tensor.dtype) != slot.dtype:
        raise RefitMismatchError(
            f"{name}: manifest {slot.shape} {slot.dtype}, "
            f"tensor {tuple(tensor.shape)} {dtype_name(tensor.dtype)}"
        )


def group_by_bucket(
    weights: Iterable[tuple[str, torch.Tensor]], plan: BucketPlan
) -> Iterator[tuple[Bucket, list[tuple[str, torch.Tensor]]]]:
    """Group a source's stream into the plan's buckets, checking every entry.

    Holds at most one bucket's tensors at a time.

    Raises:
        RefitMismatchError: the stream differs from the plan (name, order,
            shape, dtype, a missing or an extra tensor).
    """
    it = iter(weights)
    for bucket in plan.buckets:
        group: list[tuple[str, torch.Tensor]] = []
        for slot in bucket.slots:
            item = next(it, None)
            if item is None:
                raise RefitMismatchError(f"source ended before {slot.name!r}")
            _check_tensor(slot, *item)
            group.append(item)
        yield bucket, group
    extra = next(it, None)
    if extra is not None:
        raise RefitMismatchError(f"source yielded {extra[0]!r}, which is not in the manifest")
