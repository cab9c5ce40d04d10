"""The flattened_bucket wire format: planning, grouping, encoding and the restricted decoder."""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
import textwrap
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from aiosync import RefitMismatchError, TransportError
from aiosync.transports.http._wire import (
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
        flat = pack_flat(bucket, group, allocate_flat(bucket, torch.device("cpu")))
        for name, tensor in decode_flattened_bucket(serialize_flat(bucket, flat)):
            received[name] = tensor.clone()
    assert list(received) != [] and set(received) == set(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor), name


def test_non_contiguous_source_tensors_are_packed_correctly() -> None:
    manifest = {"w": ((8, 4), torch.float32)}
    base = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    plan = plan_flat_buckets(manifest, bucket_bytes=1 << 20)
    [(bucket, group)] = list(group_flat([("w", base.t())], plan, manifest))
    flat = pack_flat(bucket, group, allocate_flat(bucket, torch.device("cpu")))
    [(name, got)] = decode_flattened_bucket(serialize_flat(bucket, flat))
    assert name == "w" and torch.equal(got, base.t())


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
    import types

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
    """file_system sharing: a process that is not our child maps the same memory."""
    use_file_system_sharing()
    manifest = {"w": ((3, 5), torch.bfloat16)}
    plan = plan_flat_buckets(manifest, bucket_bytes=1 << 20)
    tensor = torch.arange(15, dtype=torch.float32).reshape(3, 5).to(torch.bfloat16)
    [(bucket, group)] = list(group_flat([("w", tensor)], plan, manifest))
    flat = pack_flat(bucket, group, allocate_flat(bucket, torch.device("cpu")))
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
