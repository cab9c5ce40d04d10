"""A sharded (FSDP2) trainer refitting an engine: the same loop on every rank.

Two trainer ranks (gloo on CPU) shard a tiny Qwen3 with ``fully_shard``. Every rank
builds its own synchronizer and makes the same calls; rank 0 alone holds the engine
(here the embedded engine, two worker processes) and checks after each refit that
the engine's greedy tokens equal the sharded trainer's.

* colocated (default): ``IPCWeightSynchronizer`` over ``process_group=``; rank ``r``
  sends its weights only to the engine worker on its own device (``device_label=``
  on the trainer, ``device_labels=`` on the engine pair them, as GPU UUIDs do);
* ``--no-colocated``: ``CollectiveWeightSynchronizer`` with each rank's
  ``TrainCluster(world_size=2, rank=r, ...)``; rank 0 broadcasts to the workers.

See docs/topology.md ("Sharded trainers"). Run::

    torchrun --nproc-per-node 2 examples/sharded.py --steps 3
    torchrun --nproc-per-node 2 examples/sharded.py --no-colocated --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import socket

import anyio
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from aiosync import (
    DEFAULT_SYNC_TIMEOUT_S,
    CollectiveWeightSynchronizer,
    EmbeddedEngine,
    IPCWeightSynchronizer,
    TrainCluster,
    WeightSynchronizer,
    refit_if_stale,
)
from aiosync.engines.embedded.configs import TINY_QWEN3 as CONFIG
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource

PROMPT = [1, 2, 3, 4]
NEW_TOKENS = 6
WORLD = 2


@torch.no_grad()
def trainer_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Greedy tokens of the sharded model; a collective (FSDP gathers each layer),
    so every rank calls it."""
    ids = torch.tensor([prompt])
    for _ in range(NEW_TOKENS):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def shared_free_port(rank: int) -> int:
    """A free port chosen on rank 0, known to every rank (the collective's TCPStore)."""
    port = [0]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = int(s.getsockname()[1])
    dist.broadcast_object_list(port, src=0)
    return port[0]


async def main(steps: int, colocated: bool) -> None:
    rank = dist.get_rank()
    # The same initial weights on every rank, then each rank keeps only its shard.
    model = HFModelRunner.from_config(CONFIG, seed=0).model.train()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = DTensorRefitSource(model, optimizer=optimizer)

    async with contextlib.AsyncExitStack() as stack:
        engine: EmbeddedEngine | None = None
        sync: WeightSynchronizer
        if colocated:
            if rank == 0:
                # One worker per trainer rank, standing for that rank's device.
                labels = [f"cpu:{r}" for r in range(WORLD)]
                engine = EmbeddedEngine(CONFIG, seed=1, num_workers=WORLD, device_labels=labels)
                await stack.enter_async_context(engine)
            sync = IPCWeightSynchronizer(
                source, engine, process_group=dist.group.WORLD, device_label=f"cpu:{rank}"
            )
        else:
            port = shared_free_port(rank)
            if rank == 0:
                engine = EmbeddedEngine(CONFIG, seed=1, num_workers=2)
                await stack.enter_async_context(engine)
            sync = CollectiveWeightSynchronizer(
                source,
                engine,
                train_cluster=TrainCluster(world_size=WORLD, rank=rank, master_port=port),
                inference_world_size=2,
                dist_backend="gloo",
            )
        await stack.enter_async_context(sync)  # init_communicator on every rank

        for step in range(steps):
            torch.manual_seed(100 * step + rank)  # each rank its own batch
            batch = torch.randint(0, CONFIG["vocab_size"], (4, 8))
            model(batch, labels=batch).loss.backward()  # FSDP reduces the gradients
            async with sync.policy_update():  # no sync reads half-stepped weights
                optimizer.step()
            optimizer.zero_grad()

            await refit_if_stale(sync)  # every rank: syncs; rank 0 also wakes the engine
            trainer_out = trainer_greedy(model, PROMPT)  # every rank
            if engine is not None:
                outs = await engine.generate(
                    [PROMPT] * engine.num_workers, max_new_tokens=NEW_TOKENS
                )
                same = all(out == trainer_out for out in outs)
                print(
                    f"{type(sync).__name__} step {step}: weight_version {sync.weight_version}  "
                    f"workers {outs}  trainer {trainer_out}  "
                    f"{'equal' if same else 'DIFFERENT'}",
                    flush=True,
                )
                if not same:
                    raise SystemExit("engine and trainer disagree after a refit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="IPC (default) or, with --no-colocated, the collective transport",
    )
    args = parser.parse_args()
    # torchrun's env:// rendezvous. A blocking gloo call cannot be cancelled: its
    # timeout, no longer than a sync's, is what bounds a rank left waiting for another.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=DEFAULT_SYNC_TIMEOUT_S))
    try:
        anyio.run(main, args.steps, args.colocated)
    finally:
        dist.destroy_process_group()
