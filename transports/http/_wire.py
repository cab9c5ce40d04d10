"""SGLang's ``update_weights_from_tensor`` wire format, both ends.

Buckets of one dtype each, flattened, sent as SGLang's ``flattened_bucket``
load format: one base64 ``ForkingPickler`` pickle per tensor-parallel rank,
carrying a handle (a CUDA-IPC handle, or on CPU the name of a ``/dev/shm``
segment this process owns, :mod:`._segment`) and SimpleNamespace metadata.
:func:`decode_flattened_bucket` is the receiving end, a restricted unpickler
for the test server. The format in detail: ``docs/sglang.md``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import pickle
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

from aiosync.errors import RefitMismatchError, TransportError

from ._segment import FlatBuffer, is_segment_path

__all__ = [
    "FLATTENED_BUCKET",
    "FlatBucket",
    "FlatBuffer",
    "FlatSlot",
    "allocate_flat",
    "decode_flattened_bucket",
    "group_flat",
    "pack_flat",
    "plan_flat_buckets",
    "serialize_flat",
    "use_file_system_sharing",
]

#: The ``load_format`` SGLang reads flattened buckets with.
FLATTENED_BUCKET = "flattened_bucket"

# Position of the device index in the argument tuple torch's ``reduce_tensor``
# returns for CUDA tensors; SGLang's ``patch_torch`` replaces the same slot.
_CUDA_DEVICE_ARG = 6


@dataclass(frozen=True, slots=True)
class FlatSlot:
    """One tensor inside a flattened bucket.

    Attributes:
        name: HF checkpoint name.
        shape: tensor shape.
        start: first element in the bucket's flat tensor (elements, not bytes).
        end: one past the last element.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class FlatBucket:
    """A flattened bucket: ``numel`` elements of one ``dtype``, tensors back to back."""

    index: int
    dtype: torch.dtype
    slots: tuple[FlatSlot, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        """Size of the flat tensor, bytes."""
        return self.numel * self.dtype.itemsize


def plan_flat_buckets(
    manifest: Mapping[str, tuple[Sequence[int], torch.dtype]], bucket_bytes: int
) -> tuple[FlatBucket, ...]:
    """Group a manifest into single-dtype buckets of at most ``bucket_bytes`` bytes.

    Tensors are taken in manifest order; each dtype has one open bucket, closed
    when the next tensor of that dtype would overflow it. A tensor larger than
    ``bucket_bytes`` travels alone in a bucket sized to it. Buckets
    are numbered in the order they close (the order a streaming source fills
    them). Cost is linear in the number of tensors.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    open_slots: dict[torch.dtype, list[FlatSlot]] = {}
    open_numel: dict[torch.dtype, int] = {}
    closed: list[tuple[torch.dtype, list[FlatSlot], int]] = []
    for name, (shape, dtype) in manifest.items():
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        slots = open_slots.setdefault(dtype, [])
        used = open_numel.get(dtype, 0)
        if slots and (used + numel) * dtype.itemsize > bucket_bytes:
            closed.append((dtype, slots, used))
            slots, used = [], 0
            open_slots[dtype] = slots
        slots.append(FlatSlot(name, shape, used, used + numel))
        open_numel[dtype] = used + numel
    # What is still open closes at the end of the stream, in first-tensor order.
    tail = sorted(
        ((dtype, slots, open_numel[dtype]) for dtype, slots in open_slots.items() if slots),
        key=lambda item: _first_position(manifest, item[1][0].name),
    )
    closed.extend(tail)
    return tuple(
        FlatBucket(i, dtype, tuple(slots), numel) for i, (dtype, slots, numel) in enumerate(closed)
    )


def _first_position(manifest: Mapping[str, Any], name: str) -> int:
    # Only called for the few buckets still open at the end (one per dtype).
    for i, key in enumerate(manifest):
        if key == name:
            return i
    return len(manifest)


def group_flat(
    weights: Iterable[tuple[str, torch.Tensor]],
    plan: Sequence[FlatBucket],
    manifest: Mapping[str, tuple[Sequence[int], torch.dtype]],
) -> Iterator[tuple[FlatBucket, list[tuple[str, torch.Tensor]]]]:
    """Group a source's stream into ``plan``'s buckets, yielding each as soon as it is full.

    Every entry is checked against ``manifest`` (name, order, shape, dtype)
    before it is accepted. At most one open bucket per dtype is held.

    Raises:
        RefitMismatchError: the stream differs from the manifest (a name out of
            order, a shape or dtype, a missing or an extra tensor).
    """
    where: dict[str, tuple[FlatBucket, int]] = {}
    for bucket in plan:
        for i, slot in enumerate(bucket.slots):
            where[slot.name] = (bucket, i)
    pending: dict[int, list[tuple[str, torch.Tensor]]] = {}
    expected = iter(manifest.items())
    for name, tensor in weights:
        item = next(expected, None)
        if item is None:
            raise RefitMismatchError(f"source yielded {name!r}, which is not in the manifest")
        want_name, (want_shape, want_dtype) = item
        if name != want_name:
            raise RefitMismatchError(f"expected {want_name!r} next, the source yielded {name!r}")
        if tuple(tensor.shape) != tuple(want_shape) or tensor.dtype != want_dtype:
            raise RefitMismatchError(
                f"{name}: manifest {tuple(want_shape)} {want_dtype}, "
                f"tensor {tuple(tensor.shape)} {tensor.dtype}"
            )
        bucket, _ = where[name]
        group = pending.setdefault(bucket.index, [])
        group.append((name, tensor))
        if len(group) == len(bucket.slots):
            del pending[bucket.index]
            yield bucket, group
    missing = next(expected, None)
    if missing is not None:
        raise RefitMismatchError(f"source ended before {missing[0]!r}")


def use_file_system_sharing() -> None:
    """Make this process pickle CPU tensors with torch's ``file_system`` strategy.

    Only for code that sends or decodes torch's own CPU reductions between
    unrelated processes (SGLang's ``FlattenedTensorBucket`` senders): the
    default ``file_descriptor`` strategy passes descriptors over a socket only
    a child process can reach. The HTTP transport does not need it (its CPU
    payloads name a ``/dev/shm`` file, :mod:`._segment`) and never calls it.
    Process-wide (it also starts torch's ``torch_shm_manager`` daemon on first
    use); idempotent.
    """
    if torch_mp.get_sharing_strategy() != "file_system":
        torch_mp.set_sharing_strategy("file_system")


def allocate_flat(bucket: FlatBucket, device: torch.device) -> FlatBuffer:
    """An uninitialised ``[bucket.numel]`` buffer of ``bucket.dtype`` for :func:`pack_flat`.

    On CPU it is a ``/dev/shm`` file this process owns and maps (nothing is
    copied when it is serialized); call ``release()`` once the server answered,
    or the post failed or was cancelled: that unlinks the file.

    Raises:
        OSError: the shared-memory file cannot be created (``/dev/shm`` full).
    """
    return FlatBuffer.allocate(bucket.numel, bucket.dtype, device)


def pack_flat(
    bucket: FlatBucket, tensors: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor
) -> torch.Tensor:
    """Copy ``tensors`` (the bucket's slots, in order, already checked) into ``out``.

    Args:
        bucket: the layout.
        tensors: ``(hf_name, tensor)`` pairs as :func:`group_flat` yields them.
        out: a ``[bucket.numel]`` tensor of ``bucket.dtype`` (``allocate_flat(...).tensor``).

    Returns:
        ``out``.
    """
    for slot, (_, tensor) in zip(bucket.slots, tensors, strict=True):
        out[slot.start : slot.end].view(slot.shape).copy_(tensor)
    return out


# Functions a payload names as globals: pickle would otherwise reach torch's C
# functions through builtins.getattr, which no restricted unpickler should admit.
_GLOBAL_NAMES: dict[int, str] = {id(torch.from_file): "from_file", id(torch.empty): "empty"}


class _SGLangPickler(ForkingPickler):
    """ForkingPickler for one flat buffer: a ``/dev/shm`` mapping on CPU, on CUDA an IPC
    handle carrying the device UUID (SGLang's ``patch_torch``)."""

    def __init__(self, file: io.BytesIO, flat: FlatBuffer) -> None:
        super().__init__(file)
        self._flat = flat

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj is not self._flat.tensor:
                raise pickle.PicklingError("a payload carries only its bucket's flat tensor")
            if obj.is_cuda:
                rebuild, args = reductions.reduce_tensor(obj)
                device = args[_CUDA_DEVICE_ARG]
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
            if self._flat.path is None:  # zero elements: nothing to map
                return functools.partial(torch.empty, dtype=obj.dtype), (0,)
            return (
                functools.partial(torch.from_file, dtype=obj.dtype),
                (self._flat.path, False, obj.numel()),
            )
        if type(obj) is functools.partial:
            # functools.partial's own reduction, not multiprocessing's _rebuild_partial.
            return obj.__reduce__()
        name = _GLOBAL_NAMES.get(id(obj))
        return name if name is not None else NotImplemented


def serialize_flat(bucket: FlatBucket, flat: FlatBuffer) -> str:
    """One ``serialized_named_tensors`` entry: base64 of a ForkingPickler pickle.

    What SGLang's ``MultiprocessingSerializer.deserialize`` turns into
    ``{"flattened_tensor": flat, "metadata": [...]}``. On CPU the tensor is a
    read-only mapping of ``flat.path`` (valid until :meth:`FlatBuffer.release`);
    on CUDA a CUDA-IPC handle. Call it once per tensor-parallel rank: each
    CUDA-IPC handle is refcounted per load.

    Args:
        bucket: the layout of ``flat``.
        flat: the packed buffer; release it only once the server answered.

    Raises:
        ValueError: ``flat`` was released or does not hold ``bucket``.
    """
    if flat.numel != bucket.numel or flat.dtype != bucket.dtype:
        raise ValueError(
            f"buffer of {flat.numel} {flat.dtype} does not hold bucket {bucket.index} "
            f"({bucket.numel} {bucket.dtype})"
        )
    metadata = [
        types.SimpleNamespace(
            name=slot.name,
            shape=torch.Size(slot.shape),
            dtype=bucket.dtype,
            start_idx=slot.start,
            end_idx=slot.end,
            numel=slot.end - slot.start,
        )
        for slot in bucket.slots
    ]
    buf = io.BytesIO()
    _SGLangPickler(buf, flat).dump({"flattened_tensor": flat.tensor, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")


# -- the receiving end (test server) -------------------------------------------


@dataclass
class _Metadata:  # no slots: unpickling a dataclass sets its __dict__
    """Stands in for SGLang's ``FlattenedTensorMetadata`` when a payload names it."""

    name: str = ""
    shape: Any = ()
    dtype: Any = None
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


_REBUILDS: frozenset[str] = frozenset(
    {
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
    }
)
_SGLANG_METADATA = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
}


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` also accepting a device UUID (SGLang's patch)."""
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        matches = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise pickle.UnpicklingError(f"no visible CUDA device has UUID {device}")
        args = (*args[:_CUDA_DEVICE_ARG], matches[0], *args[_CUDA_DEVICE_ARG + 1 :])
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*args)
    return tensor


def _map_segment(
    filename: Any, shared: Any = None, size: Any = 0, *, dtype: Any = None
) -> torch.Tensor:
    """``torch.from_file`` restricted to what a sender names: one of its bucket segments,
    mapped read-only (``MAP_PRIVATE``: nothing the server does reaches the sender)."""
    if not is_segment_path(filename) or shared or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(
            f"from_file({filename!r}, shared={shared!r}, dtype={dtype!r}) is not a bucket segment"
        )
    if not isinstance(size, int) or size < 1:
        raise pickle.UnpicklingError(f"bucket segment size {size!r} is not a positive int")
    try:
        return torch.from_file(filename, False, size, dtype=dtype)
    except RuntimeError as exc:
        # Unlinked by the sender (it gave up on this post) or shorter than declared.
        raise pickle.UnpicklingError(f"cannot map bucket segment {filename}: {exc}") from exc


def _empty_bucket(*size: Any, dtype: Any = None) -> torch.Tensor:
    """``torch.empty`` restricted to a zero-element bucket (never an allocation)."""
    if size != (0,) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"empty{size!r} is not a zero-element bucket")
    return torch.empty(0, dtype=dtype)


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits bucket segments, torch's tensor/storage rebuild functions and plain data only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch", "from_file"):
            return _map_segment
        if (module, name) == ("torch", "empty"):
            return _empty_bucket
        if (module, name) == ("functools", "partial"):
            # Only ever wraps what this method admitted.
            return functools.partial
        if module == "torch.multiprocessing.reductions" and name == "rebuild_cuda_tensor":
            return _rebuild_cuda_tensor
        if module == "torch.multiprocessing.reductions" and name in _REBUILDS:
            return getattr(reductions, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype) or name in ("Size", "Tensor", "UntypedStorage"):
                return value
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return torch.UntypedStorage
        if (module, name) == ("types", "SimpleNamespace"):
            return types.SimpleNamespace
        if (module, name) in _SGLANG_METADATA:
            return _Metadata
        raise pickle.UnpicklingError(f"payload names a forbidden global {module}.{name}")


def decode_flattened_bucket(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry into ``(hf_name, tensor)`` views.

    The views alias the sender's shared memory (or CUDA-IPC memory): copy them
    (``load_weights``) and drop them so the memory can be freed.

    Raises:
        TransportError: not base64, a pickle naming anything but a bucket
            segment, torch's rebuild functions and plain data types, a segment
            the sender already released, or metadata that does not fit the
            flat tensor.
    """
    try:
        raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    except (binascii.Error, ValueError) as exc:
        raise TransportError(f"serialized_named_tensors entry is not base64: {exc}") from exc
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise TransportError(f"rejected tensor payload: {exc}") from exc
    except Exception as exc:
        raise TransportError(f"undecodable tensor payload: {exc!r}") from exc
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise TransportError("a flattened_bucket payload must be {'flattened_tensor', 'metadata'}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise TransportError("flattened_tensor must be a 1-D tensor and metadata a list")
    out: list[tuple[str, torch.Tensor]] = []
    for meta in metadata:
        try:
            name, start, end = str(meta.name), int(meta.start_idx), int(meta.end_idx)
            shape, dtype = torch.Size(meta.shape), meta.dtype
        except (AttributeError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed metadata entry: {exc!r}") from exc
        if not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= flat.numel():
            raise TransportError(
                f"{name}: metadata [{start}:{end}] {dtype} outside the flat tensor"
            )
        try:
            tensor = flat[start:end].view(dtype).reshape(shape)
        except RuntimeError as exc:
            raise TransportError(f"{name}: cannot rebuild {tuple(shape)} {dtype}: {exc}") from exc
        out.append((name, tensor))
    return out
