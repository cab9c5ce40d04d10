"""IPC direct mode on CUDA: a trainer whose parameters ``share_parameters`` re-homed into
one CUDA-IPC-shareable arena is synced without packing (the worker process copies out of
the trainer's own GPU memory), bit-exact across AdamW steps; a parameter moved out of
the arena falls back to packing; ``expandable_segments`` does not stop it. The CPU twin
(the same harness over a shared-memory arena) runs without a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ipc_sync
import pytest
import torch

from aiosync import share_parameters

TINY = ipc_sync.qwen3_manifest(ipc_sync.QWEN3_TINY)
BUCKET_BYTES = 64 * 1024


def _check(result: dict[str, object], *, packed: int, copied: int) -> None:
    assert result["weight_version"] == 3
    assert result["mismatched"] == []
    assert result["tensors_equal"] is True
    assert result["packed_buckets"] == packed
    assert result["direct_buckets"] == result["buckets"] - packed
    assert result["copied_bytes"] == copied


def _embedding_bucket_bytes() -> int:
    # The bucket of the first tensor (the embedding), the one a moved parameter packs.
    from aiosync.transports.packing import plan_buckets

    return plan_buckets(TINY, BUCKET_BYTES).buckets[0].nbytes


@pytest.mark.gpu
def test_cuda_direct_sync_copies_out_of_the_trainer_arena_bit_exact_across_adamw_steps() -> None:
    result = ipc_sync.ipc_sync_refit(
        TINY, direct=True, bucket_bytes=BUCKET_BYTES, fetch_weights=True
    )
    _check(result, packed=0, copied=0)


@pytest.mark.gpu
def test_cuda_parameter_moved_out_of_the_arena_is_packed_and_stays_bit_exact() -> None:
    result = ipc_sync.ipc_sync_refit(
        TINY, direct=True, moved=True, bucket_bytes=BUCKET_BYTES, fetch_weights=True
    )
    _check(result, packed=1, copied=_embedding_bucket_bytes())


@pytest.mark.gpu
@pytest.mark.parametrize("verify", ["sample", True])
def test_cuda_direct_and_packed_syncs_pass_their_digests(verify: str | bool) -> None:
    # The digests of CUDA tensors (a sample gathered on the device, or every byte)
    # agree on both sides: a mismatch would fail the sync with RefitVerificationError.
    for direct in (True, False):
        result = ipc_sync.ipc_sync_refit(
            TINY, direct=direct, bucket_bytes=BUCKET_BYTES, fetch_weights=True, verify=verify
        )
        packed = 0 if direct else result["buckets"]
        _check(result, packed=packed, copied=0 if direct else result["bytes"])


@pytest.mark.gpu
def test_a_cuda_tensor_digests_as_its_host_copy() -> None:
    from aiosync.transports._verify import bucket_digest, views_digest

    gen = torch.Generator(device="cuda").manual_seed(3)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda", generator=gen)
    host = data.cpu()
    slots = [(0, 1 << 19), (1 << 19, 1 << 19)]
    for verify in ("sample", True):
        assert bucket_digest(data, verify, key=5, slots=slots) == bucket_digest(  # type: ignore[arg-type]
            host,
            verify,
            key=5,
            slots=slots,  # type: ignore[arg-type]
        )
        halves = [data[: 1 << 19], data[1 << 19 :]]
        assert views_digest(halves, verify, key=5) == bucket_digest(  # type: ignore[arg-type]
            host,
            verify,
            key=5,
            slots=slots,  # type: ignore[arg-type]
        )


@pytest.mark.gpu
def test_cuda_packed_sync_is_bit_exact() -> None:
    result = ipc_sync.ipc_sync_refit(
        TINY, direct=False, bucket_bytes=BUCKET_BYTES, fetch_weights=True
    )
    _check(result, packed=result["buckets"], copied=result["bytes"])


@pytest.mark.gpu
def test_cuda_arena_is_shareable_with_expandable_segments() -> None:
    script = Path(ipc_sync.__file__)
    # Prepended: the machine's own packages may come by PYTHONPATH too.
    paths = (str(script.parents[2]), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out = subprocess.run(
        [sys.executable, str(script), "--tiny", "--expandable"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["allocator"] == "expandable_segments:True"
    assert result["mismatched"] == [] and result["weight_version"] == 3
    assert result["packed_buckets"] == 1
    assert result["direct_buckets"] == result["buckets"] - 1


@pytest.mark.gpu
def test_cuda_share_parameters_refuses_tensors_on_two_devices() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).cuda())
    with pytest.raises(TypeError, match=re.escape("on one device: '1.weight' is on cuda:0")):
        share_parameters(module)


@pytest.mark.parametrize("moved", [False, True], ids=["in_arena", "moved"])
def test_the_same_harness_on_cpu_syncs_out_of_a_shared_memory_arena(moved: bool) -> None:
    result = ipc_sync.ipc_sync_refit(
        TINY,
        direct=True,
        moved=moved,
        bucket_bytes=BUCKET_BYTES,
        fetch_weights=True,
        device_name="cpu",
    )
    _check(result, packed=int(moved), copied=_embedding_bucket_bytes() if moved else 0)


@pytest.mark.gpu
def test_the_full_digest_runs_on_the_device_without_copying_to_the_host() -> None:
    # verify=True's digest of CUDA bytes: row sums as kernels, weighed in one kernel at
    # value(); no byte is copied to the host before value() reads the one result.
    from torch.profiler import ProfilerActivity, profile

    from aiosync._digest import BlockDigest
    from aiosync.transports._verify import bucket_digest

    gen = torch.Generator(device="cuda").manual_seed(4)
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda", generator=gen)
    slots = [(0, 1000), (1024, (1 << 20) + 13), ((1 << 20) + 4096, 2 << 20)]
    digest = BlockDigest()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for offset, nbytes in slots:
            digest.add(offset, data[offset : offset + nbytes])
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy" in e.name and "DtoH" in e.name]
    assert copies == []
    assert digest.value() == bucket_digest(data.cpu(), True, slots=slots)
