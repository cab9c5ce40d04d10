"""An FSDP2 source gathering straight into a device bucket (``GathersInto``), as the IPC
sender offers its CUDA buffer's slots: NCCL on one GPU, the same harness over gloo on CPU.

One rank (an NCCL communicator needs one device per rank, and one GPU is what a lent
machine has): a model ``fully_shard``-ed over a 1-rank mesh, so each parameter is a
``Shard(0)`` DTensor, is read through ``iter_weights_into`` with every slot of one packed
bucket offered. Every tensor must be its slot already (the gather wrote it, nothing to
pack) and equal, bit for bit, ``full_tensor()`` of its parameter. Timing is never
asserted here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests._support.net import free_ports


def _rank(port: int, queue: Any, backend: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from aiosync.refit import DTensorRefitSource
    from aiosync.transports.packing import in_place, plan_buckets, slot_view

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32)).to(device)
        fully_shard(model, mesh=init_device_mesh(device.type, (1,)))
        source = DTensorRefitSource(model, dtype=torch.bfloat16)
        plan = plan_buckets(source.prepare_refit_info(), 1 << 20)
        [bucket] = plan.buckets
        slots = {slot.name: slot for slot in bucket.slots}
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
        streamed = list(source.iter_weights_into(lambda name: slot_view(buffer, slots[name])))
        if device.type == "cuda":
            torch.cuda.synchronize()
        live = model.state_dict()
        queue.put(
            {
                "names": [name for name, _ in streamed],
                "slots": list(slots),
                "in_place": [in_place(t, slot_view(buffer, slots[n])) for n, t in streamed],
                "equal": [
                    torch.equal(
                        slot_view(buffer, slots[n]).cpu(),
                        live[n].full_tensor().to(torch.bfloat16).cpu(),  # type: ignore[attr-defined]
                    )
                    for n, _ in streamed
                ],
            }
        )
    finally:
        dist.destroy_process_group()


def _run(backend: str) -> dict[str, Any]:
    [port] = free_ports(1)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(port, queue, backend))
    proc.start()
    result: dict[str, Any] = queue.get(timeout=180)
    proc.join(60)
    assert proc.exitcode == 0
    return result


def _check(result: dict[str, Any]) -> None:
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert result["names"] == result["slots"] == names
    assert result["in_place"] == [True] * len(names)
    assert result["equal"] == [True] * len(names)


@pytest.mark.gpu
def test_nccl_gathers_each_tensor_into_its_cuda_bucket_slot_bit_exact() -> None:
    _check(_run("nccl"))


def test_the_same_check_on_gloo_gathers_into_the_host_bucket_bit_exact() -> None:
    # The GPU check's own harness, run where it can be: on CPU, over gloo.
    _check(_run("gloo"))
