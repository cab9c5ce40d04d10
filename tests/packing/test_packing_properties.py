"""Property tests of the shared bucket layout: exact round trip, alignment, size limits."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiosync._config import PACK_ALIGNMENT_BYTES
from aiosync.transports.packing import BucketPlan, group_by_bucket, pack, plan_buckets, unpack

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.bool,
]

_entry = st.tuples(
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.booleans(),  # stored non-contiguous (transposed) when it has >= 2 dims
)
_manifest_specs = st.lists(_entry, min_size=0, max_size=12)
_bucket_bytes = st.one_of(st.integers(1, 2048), st.sampled_from([512, 513, 1 << 20]))


def _tensor(
    shape: tuple[int, ...], dtype: torch.dtype, transposed: bool, seed: int
) -> torch.Tensor:
    """Random bytes of ``dtype`` (every bit pattern, NaNs included), maybe non-contiguous."""
    if transposed and len(shape) >= 2:
        base = _tensor((*shape[:-2], shape[-1], shape[-2]), dtype, False, seed)
        return base.transpose(-1, -2)
    g = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=_manifest_specs, bucket_bytes=_bucket_bytes)
def test_unpack_of_pack_is_exact_aligned_and_within_limits(
    specs: list[tuple[tuple[int, ...], torch.dtype, bool]], bucket_bytes: int
) -> None:
    tensors = {
        f"layers.{i}.w": _tensor(shape, dtype, transposed, seed=i)
        for i, (shape, dtype, transposed) in enumerate(specs)
    }
    manifest = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    plan = plan_buckets(manifest, bucket_bytes)

    # Layout: manifest order, aligned, non-overlapping, within the limit unless alone.
    assert [s.name for b in plan.buckets for s in b.slots] == list(manifest)
    assert plan.manifest() == manifest
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for index, bucket in enumerate(plan.buckets):
        assert bucket.index == index
        assert bucket.slots
        end = 0
        for slot in bucket.slots:
            assert slot.offset % PACK_ALIGNMENT_BYTES == 0
            assert slot.offset >= end
            end = slot.offset + slot.nbytes
        assert bucket.nbytes == end
        assert bucket.nbytes <= bucket_bytes or len(bucket.slots) == 1

    # Round trip, bit for bit; unpack returns views into the buffer (zero copy).
    seen: list[str] = []
    for bucket, group in group_by_bucket(tensors.items(), plan):
        buffer = pack(bucket, group)
        assert buffer.dtype == torch.uint8
        assert buffer.numel() == bucket.nbytes
        start = buffer.data_ptr()
        for name, view in unpack(buffer, bucket):
            seen.append(name)
            assert view.dtype == tensors[name].dtype
            assert view.shape == tensors[name].shape
            assert _bits(view) == _bits(tensors[name]), name
            if view.numel():
                assert start <= view.data_ptr() < start + buffer.numel()
    assert seen == list(manifest)

    # Both sides derive the same plan (and digest) from the JSON description.
    again = BucketPlan.from_json(plan.to_json())
    assert again == plan


@settings(max_examples=50, deadline=None)
@given(specs=_manifest_specs.filter(bool), bucket_bytes=_bucket_bytes)
def test_pack_into_a_reused_larger_buffer_round_trips(
    specs: list[tuple[tuple[int, ...], torch.dtype, bool]], bucket_bytes: int
) -> None:
    tensors = {f"t{i}": _tensor(s, d, tr, seed=100 + i) for i, (s, d, tr) in enumerate(specs)}
    plan = plan_buckets({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}, bucket_bytes)
    staging = torch.full((plan.max_bucket_nbytes + 7,), 0xAB, dtype=torch.uint8)
    for bucket, group in group_by_bucket(tensors.items(), plan):
        buffer = pack(bucket, group, out=staging)
        if bucket.nbytes:  # an empty slice has no data pointer
            assert buffer.data_ptr() == staging.data_ptr()
        for name, view in unpack(buffer, bucket):
            assert _bits(view) == _bits(tensors[name])


def test_a_manifest_of_zero_size_tensors_is_one_bucket_of_zero_bytes() -> None:
    # C17: nothing to pack or allocate, yet every name is in the plan and unpacks.
    manifest = {
        "a": ((0, 4), torch.float32),
        "b": ((3, 0), torch.bfloat16),
        "c": ((0,), torch.int64),
    }
    plan = plan_buckets(manifest, 1024)
    assert [(b.nbytes, [s.name for s in b.slots]) for b in plan.buckets] == [(0, ["a", "b", "c"])]
    assert (plan.total_bytes, plan.max_bucket_nbytes, plan.num_tensors) == (0, 0, 3)
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in manifest.items()}
    ((bucket, group),) = list(group_by_bucket(tensors.items(), plan))
    assert pack(bucket, group).numel() == 0
    unpacked = [
        (n, tuple(v.shape), v.dtype) for n, v in unpack(torch.empty(0, dtype=torch.uint8), bucket)
    ]
    assert unpacked == [(n, shape, dtype) for n, (shape, dtype) in manifest.items()]
