"""The flattened_bucket wire format: planning, grouping, encoding and the restricted decoder."""

from __future__ import annotations

import base64
import functools
import gc
import io
import os
import pickle
import subprocess
import sys
import textwrap
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from aiosync import RefitMismatchError, TransportError
from aiosync.transports.http._segment import SegmentPool, own_segments
from aiosync.transports.http._wire import (
    FlatBucket,
    FlatBuffer,
    allocate_flat,
    decode_flattened_bucket,
    group_flat,
    pack_flat,
    plan_flat_buckets,
    serialize_flat,
    use_file_system_sharing,
)

MIXED = {
    "embed.weight": ((64, 32), torch.bfloat16),  # 4096 bytes
    "norm.weight": ((32,), torch.float32),
    "layer.q.weight": ((16, 32), torch.bfloat16),
    "layer.scale": ((4,), torch.float32),
    "layer.k.weight": ((16, 32), torch.bfloat16),
    "layer.step": ((3,), torch.int64),
}


def _tensors(manifest: dict, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, (shape, dtype) in manifest.items():
        if dtype.is_floating_point:
            out.append((name, torch.randn(shape, generator=gen).to(dtype)))
        else:
            out.append((name, torch.randint(0, 1000, shape, generator=gen, dtype=dtype)))
    return out


def test_every_bucket_holds_one_dtype_and_every_tensor_once() -> None:
    plan = plan_flat_buckets(MIXED, bucket_bytes=2048)
    names = [s.name for b in plan for s in b.slots]
    assert sorted(names) == sorted(MIXED)
    for bucket in plan:
        assert {MIXED[s.name][1] for s in bucket.slots} == {bucket.dtype}
        ends = [0] + [s.end for s in bucket.slots]
        assert [s.start for s in bucket.slots] == ends[:-1]  # back to back, in elements
        assert bucket.numel == ends[-1]
    # The 4096-byte embedding is larger than a bucket: it travels alone (C1).
    alone = [b for b in plan if any(s.name == "embed.weight" for s in b.slots)]
    assert len(alone) == 1 and len(alone[0].slots) == 1 and alone[0].nbytes == 4096
    # q and k (1024 bytes each) share a bucket.
    qk = next(b for b in plan if any(s.name == "layer.q.weight" for s in b.slots))
    assert [s.name for s in qk.slots] == ["layer.q.weight", "layer.k.weight"]


def test_round_trip_is_bit_exact_for_every_dtype() -> None:
    plan = plan_flat_buckets(MIXED, bucket_bytes=2048)
    sent = dict(_tensors(MIXED))
    received: dict[str, torch.Tensor] = {}
    for bucket, group in group_flat(iter(sent.items()), plan, MIXED):
        flat = allocate_flat(bucket, torch.device("cpu"))
        pack_flat(bucket, group, flat.tensor)
        for name, tensor in decode_flattened_bucket(serialize_flat(bucket, flat)):
            received[name] = tensor.clone()
        flat.release()
    assert list(received) != [] and set(received) == set(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor), name


def test_non_contiguous_source_tensors_are_packed_correctly() -> None:
    manifest = {"w": ((8, 4), torch.float32)}
    base = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    plan = plan_flat_buckets(manifest, bucket_bytes=1 << 20)
    [(bucket, group)] = list(group_flat([("w", base.t())], plan, manifest))
    flat = allocate_flat(bucket, torch.device("cpu"))
    pack_flat(bucket, group, flat.tensor)
    [(name, got)] = decode_flattened_bucket(serialize_flat(bucket, flat))
    assert name == "w" and torch.equal(got, base.t())
    flat.release()


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        ([("norm.weight", torch.zeros(32))], "expected 'embed.weight' next"),
        ([("embed.weight", torch.zeros(64, 32))], r"embed.weight: manifest \(64, 32\)"),
        ([("embed.weight", torch.zeros(63, 32, dtype=torch.bfloat16))], r"tensor \(63, 32\)"),
    ],
)
def test_a_stream_that_differs_from_the_manifest_is_refused(stream: list, match: str) -> None:
    plan = plan_flat_buckets(MIXED, bucket_bytes=2048)
    with pytest.raises(RefitMismatchError, match=match):
        list(group_flat(stream, plan, MIXED))


def test_a_short_or_long_stream_is_refused() -> None:
    plan = plan_flat_buckets(MIXED, bucket_bytes=2048)
    items = _tensors(MIXED)
    with pytest.raises(RefitMismatchError, match=r"source ended before 'layer\.step'"):
        list(group_flat(items[:-1], plan, MIXED))
    with pytest.raises(
        RefitMismatchError, match=r"source yielded 'extra', which is not in the manifest"
    ):
        list(group_flat([*items, ("extra", torch.zeros(1))], plan, MIXED))


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "obj",
    [
        {"flattened_tensor": _Evil(), "metadata": []},
        {"flattened_tensor": torch.zeros(2), "metadata": [io.BytesIO(b"x")]},
    ],
)
def test_decoder_rejects_payloads_naming_other_callables(obj: object) -> None:
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    with pytest.raises(TransportError, match="forbidden global"):
        decode_flattened_bucket(payload)


def test_decoder_rejects_metadata_outside_the_flat_tensor() -> None:
    meta = types.SimpleNamespace(
        name="w", shape=torch.Size([4]), dtype=torch.float32, start_idx=0, end_idx=9, numel=9
    )
    use_file_system_sharing()
    flat = torch.zeros(4)
    raw = bytes(ForkingPickler.dumps({"flattened_tensor": flat, "metadata": [meta]}))
    payload = base64.b64encode(raw).decode()
    with pytest.raises(TransportError, match="outside the flat tensor"):
        decode_flattened_bucket(payload)
    with pytest.raises(TransportError, match="not base64"):
        decode_flattened_bucket("@@not base64@@")


@pytest.mark.slow
def test_cpu_handles_open_in_an_unrelated_process() -> None:
    """A process that is not our child maps the same memory, by the segment's name."""
    manifest = {"w": ((3, 5), torch.bfloat16)}
    plan = plan_flat_buckets(manifest, bucket_bytes=1 << 20)
    tensor = torch.arange(15, dtype=torch.float32).reshape(3, 5).to(torch.bfloat16)
    [(bucket, group)] = list(group_flat([("w", tensor)], plan, manifest))
    flat = allocate_flat(bucket, torch.device("cpu"))
    pack_flat(bucket, group, flat.tensor)
    payload = serialize_flat(bucket, flat)
    code = textwrap.dedent(
        """
        import sys
        from aiosync.transports.http._wire import decode_flattened_bucket
        [(name, t)] = decode_flattened_bucket(sys.stdin.read())
        print(name, t.float().flatten().tolist())
        """
    )
    # start_new_session: not a multiprocessing child, shares nothing but the name.
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=payload,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
        check=True,
    ).stdout.split(" ", 1)
    assert out[0] == "w"
    assert out[1].strip() == str([float(i) for i in range(15)])
    flat.release()
    assert flat.path is not None and not os.path.exists(flat.path)


def _one_bucket(
    shape: tuple[int, ...] = (4, 3), dtype: torch.dtype = torch.float32
) -> tuple[FlatBucket, FlatBuffer, torch.Tensor]:
    manifest = {"w": (shape, dtype)}
    [bucket] = plan_flat_buckets(manifest, bucket_bytes=1 << 20)
    tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype)
    flat = allocate_flat(bucket, torch.device("cpu"))
    pack_flat(bucket, [("w", tensor)], flat.tensor)
    return bucket, flat, tensor


def test_payload_names_only_globals_sglangs_safe_unpickler_admits() -> None:
    """SGLang's ``SafeUnpickler`` admits a global whose module starts with one of its
    prefixes (``torch.``, ``functools.``, ``types.``, ...; ``sglang/srt/utils/common.py``);
    ours name nothing else, not even ``builtins.getattr``."""

    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.add((module, name))
            return super().find_class(module, name)

    bucket, flat, tensor = _one_bucket(dtype=torch.bfloat16)
    raw = base64.b64decode(serialize_flat(bucket, flat))
    loaded = Recording(io.BytesIO(raw)).load()
    assert sorted(seen) == [
        ("functools", "partial"),
        ("torch", "Size"),
        ("torch", "bfloat16"),
        ("torch", "from_file"),
        ("types", "SimpleNamespace"),
    ]
    assert torch.equal(loaded["flattened_tensor"].view(4, 3), tensor)
    assert flat.path is not None and flat.path in raw.decode("latin-1")
    assert flat.path.startswith(f"/dev/shm/aiosync-http-{os.getpid()}-")
    flat.release()


def test_a_released_segment_is_a_typed_error_and_maps_nothing() -> None:
    bucket, flat, _ = _one_bucket()
    payload = serialize_flat(bucket, flat)
    path = flat.path
    assert path is not None and path.rsplit("/", 1)[1] in own_segments()
    flat.release()
    flat.release()  # idempotent
    assert flat.released and not os.path.exists(path)
    with pytest.raises(TransportError, match=r"cannot map bucket segment /dev/shm/aiosync-http-"):
        decode_flattened_bucket(payload)
    # The decoder never creates the file it was told to map.
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="released"):
        serialize_flat(bucket, flat)


@pytest.mark.parametrize(
    "call",
    [
        ("/etc/passwd", False, 4),
        ("/dev/shm/torch_1_2", False, 4),
        ("/dev/shm/aiosync-http-1-0123456789abcdef", True, 4),  # a writable mapping
        ("/dev/shm/aiosync-http-1-0123456789abcdef/../x", False, 4),
    ],
)
def test_decoder_maps_only_bucket_segments_read_only(call: tuple[str, bool, int]) -> None:
    class Forged:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return functools.partial(torch.from_file, dtype=torch.float32), call

    meta = types.SimpleNamespace(
        name="w", shape=torch.Size([4]), dtype=torch.float32, start_idx=0, end_idx=4, numel=4
    )

    class ByName(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if obj is torch.from_file:
                return "from_file"  # a global, as a sender names it
            if type(obj) is functools.partial:
                return obj.__reduce__()
            return NotImplemented

    buf = io.BytesIO()
    ByName(buf).dump({"flattened_tensor": Forged(), "metadata": [meta]})
    payload = base64.b64encode(buf.getvalue())
    with pytest.raises(TransportError, match="is not a bucket segment"):
        decode_flattened_bucket(payload.decode())


def test_a_zero_element_bucket_travels_without_a_segment() -> None:
    bucket, flat, _ = _one_bucket(shape=(0, 3))
    assert flat.path is None
    [(name, got)] = decode_flattened_bucket(serialize_flat(bucket, flat))
    assert name == "w" and got.shape == (0, 3) and got.dtype == torch.float32
    flat.release()


def test_a_forgotten_buffer_is_unlinked_when_collected() -> None:
    _, flat, _ = _one_bucket()
    path = flat.path
    assert path is not None and os.path.exists(path)
    del flat
    gc.collect()
    assert not os.path.exists(path)


def test_a_pool_reuses_answered_segments_and_clear_unlinks_every_one() -> None:
    """Pooled segments carry bucket after bucket (a payload names a prefix of one);
    a tensor larger than ``segment_bytes`` gets a segment of its size, kept too;
    ``clear`` unlinks them all and a payload of a cleared segment maps nothing."""
    before = set(own_segments())
    pool = SegmentPool(4096)
    plan = plan_flat_buckets(MIXED, bucket_bytes=4096)
    tensors = dict(_tensors(MIXED))
    first, second = pool.take(plan[0].numel, plan[0].dtype), pool.take(16, torch.float32)
    assert first.path != second.path and {first.path, second.path} == set(pool.paths)
    assert not first.owned and first.segment is not None and first.segment.nbytes == 4096
    [(bucket, group)] = [g for g in group_flat(tensors.items(), plan, MIXED) if g[0] is plan[0]]
    pack_flat(bucket, group, first.tensor)
    decoded = dict(decode_flattened_bucket(serialize_flat(bucket, first)))
    assert all(torch.equal(decoded[name], tensor) for name, tensor in group)

    # Answered: the next bucket of another dtype and size lands in the same file.
    path = first.path
    pool.recycle(first)
    assert first.released
    again = pool.take(3, torch.int64)
    assert again.path == path and set(own_segments()) - before == {
        p.rsplit("/", 1)[1] for p in pool.paths
    }
    again.tensor.copy_(torch.tensor([7, 8, 9]))
    manifest = {"layer.step": ((3,), torch.int64)}
    [step_bucket] = plan_flat_buckets(manifest, bucket_bytes=4096)
    [(name, value)] = decode_flattened_bucket(serialize_flat(step_bucket, again))
    assert name == "layer.step" and value.tolist() == [7, 8, 9]

    # Larger than segment_bytes: a segment of its own size, smallest fit first later.
    big = pool.take(2048, torch.float32)
    assert big.segment is not None and big.segment.nbytes == 8192 and len(pool.paths) == 3
    pool.recycle(big)
    pool.recycle(again)
    small = pool.take(4, torch.float32)
    assert small.path == path  # the 4096-byte one, not the 8192-byte one
    empty = pool.take(0, torch.bfloat16)
    assert empty.path is None and empty.numel == 0

    # A post that was not answered: clear() unlinks every file, held views included.
    payload = serialize_flat(step_bucket, pool.take(3, torch.int64))
    pool.clear()
    assert pool.paths == [] and set(own_segments()) - before == set()
    with pytest.raises(TransportError, match="cannot map bucket segment"):
        decode_flattened_bucket(payload)
    pool.recycle(small)  # unlinked meanwhile: never handed out again
    assert pool.take(4, torch.float32).path not in {path, None}
    pool.clear()
    assert set(own_segments()) - before == set()
