"""Non-colocated refit: a torch.distributed broadcast from the trainer to every engine worker.

The trainer and the engine's workers (here two embedded-engine processes, as
if on another machine) form a dedicated process group (gloo on CPU, NCCL on
GPU) at ``TrainCluster.master_addr:master_port``; ``create_weight_synchronizer``
picks ``CollectiveWeightSynchronizer`` for ``colocated=False``. After each
refit every worker's greedy output equals the trainer's.

Run::

    python examples/collective.py --steps 3
"""

from __future__ import annotations

import argparse
import socket

import anyio
import torch

from aiosync import TrainCluster, create_weight_synchronizer, refit_if_stale
from aiosync.engines.embedded.configs import TINY_QWEN3 as CONFIG
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource

PROMPT = [1, 2, 3, 4]
WORKERS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(steps: int) -> None:
    trainer = HFModelRunner.from_config(CONFIG, seed=0)
    model = trainer.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = DTensorRefitSource(model, optimizer=optimizer)
    async with EmbeddedEngine(CONFIG, seed=0, num_workers=WORKERS) as engine:
        sync = create_weight_synchronizer(
            source,
            engine,
            colocated=False,
            backend="embedded",
            train_cluster=TrainCluster(world_size=1, rank=0, master_port=free_port()),
            inference_world_size=WORKERS,
        )
        async with sync:  # initializes the communicator
            for _ in range(steps):
                # One optimizer step on a toy objective, then the handshake.
                batch = torch.randint(0, 128, (4, 8))
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                await sync.mark_stale()

                await refit_if_stale(sync, engine)
                # One prompt per worker (data parallel): both must answer like the trainer.
                outs = await engine.generate([PROMPT] * WORKERS, max_new_tokens=6)
                (trainer_out,) = trainer.generate([PROMPT], max_new_tokens=6)
                same = all(out == trainer_out for out in outs)
                print(
                    f"{type(sync).__name__}: weight_version {sync.weight_version}  "
                    f"workers {outs}  trainer {trainer_out}  {'equal' if same else 'DIFFERENT'}"
                )
                if not same:
                    raise SystemExit("engine and trainer disagree after a refit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    anyio.run(main, parser.parse_args().steps)
