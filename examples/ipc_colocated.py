"""Colocated refit over IPC: trainer and engine share the machine, weights travel by shared memory.

A tiny Qwen3 policy (transformers, built from a config) takes optimizer steps;
after each one the loop marks the synchronizer stale, and before generating it
refits through ``IPCWeightSynchronizer`` (picked by ``create_weight_synchronizer``
for ``colocated=True``) into the embedded engine's worker process. The engine's
greedy output then equals the trainer's own.

Run::

    python examples/ipc_colocated.py --steps 3
"""

from __future__ import annotations

import argparse

import anyio
import torch

from aiosync import create_weight_synchronizer, refit_if_stale
from aiosync.engines.embedded.configs import TINY_QWEN3 as CONFIG
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource

PROMPT = [1, 2, 3, 4]


async def main(steps: int) -> None:
    trainer = HFModelRunner.from_config(CONFIG, seed=0)
    model = trainer.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = DTensorRefitSource(model, optimizer=optimizer)
    async with EmbeddedEngine(CONFIG, seed=0) as engine:
        sync = create_weight_synchronizer(source, engine, colocated=True, backend="embedded")
        async with sync:  # initializes the communicator
            for _ in range(steps):
                # One optimizer step on a toy objective, then the handshake.
                batch = torch.randint(0, 128, (4, 8))
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                await sync.mark_stale()

                await refit_if_stale(sync, engine)
                (engine_out,) = await engine.generate([PROMPT], max_new_tokens=6)
                (trainer_out,) = trainer.generate([PROMPT], max_new_tokens=6)
                print(
                    f"{type(sync).__name__}: weight_version {sync.weight_version}  "
                    f"engine {engine_out}  trainer {trainer_out}  "
                    f"{'equal' if engine_out == trainer_out else 'DIFFERENT'}"
                )
                if engine_out != trainer_out:
                    raise SystemExit("engine and trainer disagree after a refit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    anyio.run(main, parser.parse_args().steps)
