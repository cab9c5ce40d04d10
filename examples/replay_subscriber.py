"""A replay buffer that follows the weight-version event stream.

``VersionedReplayBuffer`` subscribes to the synchronizer's events (STALE,
SYNC_STARTED, COMMITTED, FAILED, OVERFLOW), stamps every rollout with the weight
version it was generated under, and drops rollouts more than ``max_staleness``
optimizer steps behind the policy when a newer version commits. A second,
plain subscriber prints the events as they happen.

Here the engine is refit only every other step and two rollouts are made per
step while the trainer uses one, so rollouts age: with ``max_staleness=1`` the
ones two steps old are dropped when the next version commits.

Run::

    python examples/replay_subscriber.py --steps 6
"""

from __future__ import annotations

import argparse

import anyio
import torch

from aiosync import EventSubscription, create_weight_synchronizer, refit_if_stale
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.replay import VersionedReplayBuffer

CONFIG = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "tie_word_embeddings": False,
}  # fmt: skip
PROMPTS = [[1, 2, 3], [4, 5, 6]]


async def print_events(events: EventSubscription) -> None:
    async for ev in events:
        extra = f" {ev.nbytes} bytes in {ev.duration_s * 1e3:.1f} ms" if ev.nbytes else ""
        print(f"  event {ev.kind.name:<12} version {ev.version}{extra}")


async def main(steps: int) -> None:
    model = HFModelRunner.from_config(CONFIG, seed=0).model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    source = DTensorRefitSource(model, optimizer=optimizer)
    async with EmbeddedEngine(CONFIG, seed=0) as engine:
        sync = create_weight_synchronizer(source, engine, colocated=True, backend="embedded")
        async with sync:  # initializes the communicator
            buffer: VersionedReplayBuffer[list[int]] = VersionedReplayBuffer(sync, max_staleness=1)
            async with buffer, anyio.create_task_group() as tg:
                tg.start_soon(print_events, sync.subscribe())
                for step in range(steps):
                    if step % 2 == 0:
                        await refit_if_stale(sync, engine)
                    rollouts = await engine.generate(
                        PROMPTS, max_new_tokens=4, temperature=1.0, seed=step
                    )
                    buffer.extend(rollouts, weight_version=sync.weight_version)
                    # The trainer uses one rollout per step, the oldest usable one.
                    (sample,) = await buffer.pop_batch(1)
                    print(
                        f"step {step}: train on a rollout of v{sample.target_weight_version} "
                        f"(staleness {sample.staleness})"
                    )
                    batch = torch.tensor([PROMPTS[0] + sample.item])
                    model(batch, labels=batch).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    await sync.mark_stale()
                    await anyio.sleep(0.05)  # let the subscribers catch up before printing
                    print(
                        f"        policy v{sync.policy_version} weights v{sync.weight_version}"
                        f"  buffer holds versions {buffer.versions()}"
                    )
                await refit_if_stale(sync, engine)
                await anyio.sleep(0.05)
                used = [(s.target_weight_version, s.staleness) for s in buffer.drain()]
                print(f"usable at the end (version, staleness): {used}")
                print(buffer.format_histogram())
                tg.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    anyio.run(main, parser.parse_args().steps)
