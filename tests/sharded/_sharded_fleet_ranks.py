"""One rank of a 2-rank FSDP2 trainer (gloo) refitting fleets of embedded engines through
the shard-aware transport.

Run as ``python _sharded_fleet_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT_TP1 STORE_PORT_DP2XTP2
OUT_JSON``. Rank 0 holds, one after the other:

1. ``"tp1"``: a fleet of two TP=1 engines (two workers, each holding every tensor
   whole), built by the factory with ``sharded=True``;
2. ``"dp2xtp2"``: a fleet of two TP=2 engines (four workers, DP=2 x TP=2), the
   factory's own pick.

Each fleet takes two syncs (weights advanced in between). Each rank writes what it saw
to ``OUT_JSON``: per fleet, the synchronizer class, versions, the plan's bytes per
sender and receiver, each worker's bytes per sender, whether every worker holds its
part of the trainer's full tensors bit for bit, and greedy tokens of the trainer and
of every engine.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync import EngineFleet, TrainCluster, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from tests._support import fsdp2

FLEETS = {"tp1": (1, 1), "dp2xtp2": (2, 2)}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def _greedy(full: dict[str, torch.Tensor]) -> list[list[int]]:
    runner = HFModelRunner.from_config(TINY_QWEN3, seed=0)
    runner.load_weights(full.items())
    return runner.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)


async def run_fleet(
    name: str, rank: int, world: int, store_port: int, model: torch.nn.Module
) -> dict[str, Any]:
    source = DTensorRefitSource(model)
    sizes = FLEETS[name]
    seen: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        fleet: EngineFleet | None = None
        if rank == 0:
            engines = [
                await stack.enter_async_context(
                    EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=tp, seed=fsdp2.ENGINE_SEED + i)
                )
                for i, tp in enumerate(sizes)
            ]
            fleet = EngineFleet(engines)
        # Every rank forms the sync group only once rank 0's engines are up: rank 1 has
        # none to start and would otherwise spend its formation limit waiting for rank 0
        # to spawn four worker processes on a loaded machine. Each fleet meets on its own
        # store port, so the second formation never races the first one's teardown.
        dist.barrier()
        sync = fsdp2.factory_rank_sync(
            source,
            fleet,
            rank,
            world,
            store_port,
            inference_world_size=sum(sizes),
            # Rank 1 has no engine to ask: every rank says what rank 0's factory picks.
            sharded=True,
            bucket_bytes=16 * 1024,
            # Rank 1 waits in the formation while rank 0 starts its engines (up to six
            # worker processes on a loaded 2-core machine).
            collective_timeout_s=120.0,
            sync_timeout_s=120.0,
        )
        seen["class"] = type(sync).__name__
        if fleet is not None:
            seen["factory_pick"] = type(
                create_weight_synchronizer(
                    source,
                    fleet,
                    colocated=False,
                    backend="embedded",
                    train_cluster=TrainCluster(world_size=world, rank=0, master_port=1),
                    inference_world_size=sum(sizes),
                )
            ).__name__
        await stack.enter_async_context(sync)
        plan = sync.transfer_plan  # type: ignore[attr-defined]
        seen["sender_nbytes"] = list(plan.sender_nbytes)
        seen["receiver_nbytes"] = list(plan.receiver_nbytes)
        for step in range(2):
            await fsdp2.stepped_sync(model, sync, step)
            full = {n: t.clone() for n, t in source.iter_weights()}  # every rank gathers
            if fleet is not None:
                await fleet.prepare_for_generation()
                seen[f"holds_{step}"] = await fsdp2.slices_match(fleet, full)
                seen[f"by_sender_{step}"] = [r["by_sender"] for r in sync.last_worker_results]  # type: ignore[attr-defined]
                seen[f"greedy_{step}"] = [
                    await e.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
                    for e in fleet.engines
                ]
                seen[f"trainer_greedy_{step}"] = _greedy(full)
        seen["versions"] = fsdp2.versions(sync)
        if fleet is not None:
            seen["manifest_nbytes"] = sum(t.numel() * t.element_size() for t in full.values())
            seen["slice_nbytes"] = [
                sum(p.numel * full[n].element_size() for n, p in layout.items())
                for layout in await fleet.weight_layouts()
            ]
        dist.barrier()
    return seen


async def run(rank: int, world: int, *store_ports: int) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    return {
        name: await run_fleet(name, rank, world, port, model)
        for name, port in zip(FLEETS, store_ports, strict=True)
    }


if __name__ == "__main__":
    fsdp2.rank_main(run, store_ports=2)
