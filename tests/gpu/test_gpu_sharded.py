"""The shard-aware transfer on GPUs: run_plan's point-to-point buckets over NCCL.

The NCCL check needs two GPUs (an NCCL communicator holds one rank per device): trainer rank 0 on
``cuda:0`` sends its dim-0 shards, inference worker 1 on ``cuda:1`` holds a TP=2
slice (column- and row-parallel parts) and must end bit-exact. The same harness
runs on CPU over gloo, so it is known to work before a GPU is lent. Timing is
never asserted here."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from aiosync.layout import Part

#: ``{name: (shape, destination part)}``: a column-parallel and a row-parallel weight,
#: a replicated norm; the worker holds TP rank 1 of 2.
TENSORS: dict[str, tuple[tuple[int, ...], Part]] = {
    "q_proj.weight": ((256, 128), Part((256, 128), 0, 128, 128)),
    "o_proj.weight": ((128, 256), Part((128, 256), 1, 128, 128)),
    "norm.weight": ((128,), Part.whole((128,))),
}


def _full(name: str) -> torch.Tensor:
    shape = TENSORS[name][0]
    generator = torch.Generator().manual_seed(len(name))
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def _rank(rank: int, port: int, queue: Any, backend: str) -> None:
    from aiosync.transports.collective._group import create_sync_group, open_store
    from aiosync.transports.sharded import make_plan, run_plan
    from aiosync.transports.sharded._plan import box_within

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    store = open_store("127.0.0.1", port, is_master=rank == 0, timeout_s=60)
    group = create_sync_group(
        store=store,
        rank=rank,
        world_size=2,
        train_world_size=1,
        backend=backend,
        device=device,
        timeout_s=60,
        session="gpu-p2p",
        every_rank_sends=True,
    )
    sources = [{n: Part.whole(shape) for n, (shape, _) in TENSORS.items()}]
    destinations = [{n: part for n, (_, part) in TENSORS.items()}]
    plan = make_plan(sources, destinations, dict.fromkeys(TENSORS, torch.bfloat16), 64 * 1024)
    try:
        if rank == 0:
            local = {n: _full(n).to(device) for n in TENSORS}
            run_plan(plan, group.data, 0, source=local.__getitem__, device=device, timeout_s=60)
            queue.put((rank, None))
            return
        held = {
            n: torch.zeros(part.local_shape, dtype=torch.bfloat16, device=device)
            for n, (_, part) in TENSORS.items()
        }

        def sink(name: str, box: Any, tensor: torch.Tensor) -> None:
            held[name][box_within(box, TENSORS[name][1])].copy_(tensor)

        result = run_plan(plan, group.data, 1, sink=sink, device=device, timeout_s=60)
        equal = {
            n: torch.equal(held[n].cpu(), _full(n).narrow(part.dim, part.start, part.length))
            for n, (_, part) in TENSORS.items()
        }
        queue.put(
            (rank, {"equal": equal, "nbytes": result.nbytes, "planned": plan.receiver_nbytes[0]})
        )
    finally:
        group.destroy()


def _run(backend: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue, backend)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    worker: dict[str, Any] = results[1]
    return worker


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL P2P needs two GPUs")
def test_nccl_point_to_point_lands_each_slice_bit_exact() -> None:
    worker = _run("nccl")
    assert worker["equal"] == dict.fromkeys(TENSORS, True)
    assert worker["nbytes"] == worker["planned"]


def test_the_same_check_on_gloo_lands_each_slice_bit_exact() -> None:
    # The GPU check's own harness, run where it can be: on CPU, over gloo.
    worker = _run("gloo")
    assert worker["equal"] == dict.fromkeys(TENSORS, True)
    assert worker["nbytes"] == worker["planned"]
