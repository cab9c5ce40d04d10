"""Single-GPU contracts: CUDA-IPC refit is bit-exact, packing on device round-trips,
JAX arrays reach torch without a copy. Timing is printed by run.sh, never asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gpu_checks
import pytest
import torch

from aiosync.transports.packing import pack, plan_buckets, unpack

pytestmark = pytest.mark.gpu


def test_cuda_ipc_refit_between_two_processes_is_bit_exact() -> None:
    manifest = gpu_checks.qwen3_manifest(gpu_checks.QWEN3_TINY)
    # 64 KiB buckets: several buckets per refit, so both rotating buffers are reused.
    result = gpu_checks.ipc_refit(manifest, bucket_bytes=64 * 1024, rounds=2, full_compare=True)
    assert result["buckets"] > 2
    assert result["mismatched"] == []
    assert result["bit_exact"] is True
    assert result["tensors_equal"] is True


def test_cuda_ipc_refit_of_a_tensor_larger_than_the_bucket_is_bit_exact() -> None:
    # Case C1: the embedding (128 x 64 bf16 = 16 KiB) exceeds an 8 KiB bucket.
    manifest = gpu_checks.qwen3_manifest(gpu_checks.QWEN3_TINY)
    result = gpu_checks.ipc_refit(manifest, bucket_bytes=8 * 1024, rounds=1, full_compare=True)
    assert result["tensors_equal"] is True


def test_pack_on_device_round_trips_every_tensor_bit_exactly() -> None:
    device = torch.device("cuda", 0)
    manifest = gpu_checks.qwen3_manifest(gpu_checks.QWEN3_TINY)
    plan = plan_buckets(manifest, 32 * 1024)
    gen = torch.Generator(device=device).manual_seed(3)
    weights = {
        n: torch.randn(shape, generator=gen, device=device).to(dtype)
        for n, (shape, dtype) in manifest.items()
    }
    out = torch.empty(plan.max_bucket_nbytes, dtype=torch.uint8, device=device)
    for bucket in plan.buckets:
        buf = pack(bucket, ((s.name, weights[s.name]) for s in bucket.slots), out=out)
        assert buf.is_cuda
        for name, view in unpack(buf, bucket):
            assert view.data_ptr() % 512 == 0 or view.numel() == 0
            assert torch.equal(view, weights[name]), name


def test_jax_array_reaches_torch_through_dlpack_without_a_copy() -> None:
    pytest.importorskip("jax", reason="jax is not installed")
    result = gpu_checks.dlpack_check(numel=4096)
    if result["status"] == "skipped":
        pytest.skip(result["reason"])
    assert result["zero_copy"] is True
    assert result["values_equal"] is True
    assert result["dtype"] == "torch.bfloat16"
    assert result["numel"] == 4096


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two ranks needs two GPUs")
def test_nccl_collective_refit_between_two_gpus_is_bit_exact() -> None:
    manifest = gpu_checks.qwen3_manifest(gpu_checks.QWEN3_TINY)
    result = gpu_checks.collective_refit(manifest, backend="nccl", bucket_bytes=64 * 1024)
    assert result["weight_version"] == 2
    assert result["mismatched"] == []
    assert result["bit_exact"] is True


def test_device_identity_is_the_gpu_uuid_and_a_worker_on_the_device_pairs_with_it() -> None:
    # Sharded IPC pairing keys trainer ranks and engine workers by GPU UUID.
    import shutil
    import subprocess

    from aiosync.transports._identity import WorkerIdentityMixin, device_identity

    identity = device_identity(torch.device("cuda", 0))
    assert identity.startswith("GPU-")
    if shutil.which("nvidia-smi"):
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        assert f"(UUID: {identity})" in listing
    torch.cuda.set_device(0)
    assert WorkerIdentityMixin().aiosync_device_identity() == identity


_EXPANDABLE_PROBE = """
import torch
import torch.multiprocessing as mp

from aiosync.transports.ipc._shm import SharedBuffer, open_handle


def child(handle, queue):
    mapped = open_handle(handle)
    queue.put(int(mapped.tensor.to(torch.int64).sum()))
    mapped.close()


if __name__ == "__main__":
    buffer = SharedBuffer.create(1 << 20, "cuda:0")
    buffer.tensor.copy_(torch.arange(1 << 20, device="cuda:0") % 251)
    torch.cuda.synchronize()
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=child, args=(buffer.handle(), queue))
    proc.start()
    print(queue.get(timeout=120))
    proc.join(60)
    buffer.close()
"""


def test_shared_buffers_are_ipc_shareable_with_expandable_segments(tmp_path: Path) -> None:
    # C20: the trainer runs with expandable segments on, as many do to fight fragmentation.
    script = tmp_path / "probe.py"
    script.write_text(_EXPANDABLE_PROBE)
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # Prepended: the machine's own packages may come by PYTHONPATH too.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")) if p
    )
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) == sum(i % 251 for i in range(1 << 20))
