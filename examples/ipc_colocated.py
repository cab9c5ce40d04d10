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
from typing import Any

import anyio
import torch

from aiosync import create_weight_synchronizer, refit_if_stale
from refit import DTensorRefitSource
from transports.embedded.engine import EmbeddedEngine
from transports.embedded.model import HFModelRunner

CONFIG = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "tie_word_embeddings": False,
}  # fmt: skip
PROMPT = [1, 2, 3, 4]


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


async def main(steps: int) -> None:
    model = HFModelRunner.from_config(CONFIG, seed=0).model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = DTensorRefitSource(model, optimizer=optimizer)
    async with EmbeddedEngine(CONFIG, seed=0) as engine:
        sync = create_weight_synchronizer(source, engine, colocated=True, backend="embedded")
        async with sync:
            await sync.init_communicator()
            for _ in range(steps):
                # One optimizer step on a toy objective, then the handshake.
                batch = torch.randint(0, 128, (4, 8))
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                await sync.mark_stale()

                await refit_if_stale(sync, engine)
                (engine_out,) = await engine.generate([PROMPT], max_new_tokens=6)
                trainer_out = greedy(model.eval(), PROMPT, 6)
                model.train()
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
