"""A rank of a 2-rank FSDP2 trainer (gloo) as a Ray actor, refitting a fleet of engine actors.

The test starts two :class:`TrainerRank` actors and two engine actors. Rank 0 chooses
the addresses (its node's IP as Ray knows it, ports free there:
:func:`aiosync.ray.sync_group_address`); the driver hands the ObjectRefs of those calls
to both ranks' ``run`` as top-level arguments, and Ray resolves them before either
runs. Rank 0 wraps the engine actors' handles in :class:`~aiosync.ray.RayEngine`
objects and an :class:`~aiosync.EngineFleet`; rank 1 has no engine. Each rank returns
what it saw.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import torch
import torch.distributed as dist

from aiosync import EngineFleet, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.ray import RayEngine, SyncGroupAddress, sync_group_address
from aiosync.refit import DTensorRefitSource
from tests._support.fsdp2 import advance_weights, build_sharded_model, versions

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
#: The transports the ranks run, one after the other: (name, sharded=, initial_version).
RUNS = (("broadcast", False, 0), ("sharded", True, 10))


def _greedy(full: dict[str, torch.Tensor]) -> list[list[int]]:
    runner = HFModelRunner.from_config(TINY_QWEN3, seed=0)
    runner.load_weights(full.items())
    return runner.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)


class TrainerRank:
    """One trainer rank (the actor's body)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        torch.set_num_threads(1)

    def address(self) -> SyncGroupAddress:
        """Rank 0: this node's IP and a free port (one group's meeting point)."""
        return sync_group_address()

    async def run(
        self, group: SyncGroupAddress, engines: list[Any] | None, *sync_groups: SyncGroupAddress
    ) -> dict[str, Any]:
        """Form the trainer's group at ``group``, then one sync group per :data:`RUNS` at
        ``sync_groups`` (top-level arguments: Ray resolves the ObjectRefs passed for them)."""
        dist.init_process_group(
            "gloo", init_method=group.init_method, rank=self.rank, world_size=self.world
        )
        try:
            return await self._run(list(sync_groups), engines)
        finally:
            dist.destroy_process_group()

    async def _run(
        self, sync_groups: list[SyncGroupAddress], engines: list[Any] | None
    ) -> dict[str, Any]:
        model = build_sharded_model(self.world)
        source = DTensorRefitSource(model)
        fleet: EngineFleet | None = None
        if engines is not None:
            members = [RayEngine(handle) for handle in engines]
            for member in members:
                await member.start()  # the engines run already: start only describes them
            fleet = EngineFleet(members)
        seen: dict[str, Any] = {"addresses": [(a.host, a.port) for a in sync_groups]}
        for (name, sharded, base), where in zip(RUNS, sync_groups, strict=True):
            sync = create_weight_synchronizer(
                source,
                fleet,
                colocated=False,
                backend="embedded",
                train_cluster=where.train_cluster(rank=self.rank, world_size=self.world),
                inference_world_size=2,
                sharded=sharded,
                initial_version=base,
                bucket_bytes=16 * 1024,
                collective_timeout_s=120.0,
                sync_timeout_s=120.0,
            )
            run: dict[str, Any] = {"class": type(sync).__name__, "holds": [], "greedy": []}
            events = sync.subscribe()
            async with sync:
                await sync.mark_stale()
                for step in range(2):
                    if step:
                        async with sync.policy_update():
                            advance_weights(model)
                    await sync.sync_weights()
                    full = {n: t.clone() for n, t in source.iter_weights()}  # every rank
                    if fleet is not None:
                        await fleet.prepare_for_generation()
                        run["holds"].append(
                            [
                                list(state) == list(full)
                                and all(torch.equal(state[n], t) for n, t in full.items())
                                for state in await fleet.hf_state_dicts()
                            ]
                        )
                        run["greedy"].append(
                            (
                                _greedy(full),
                                [
                                    await e.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
                                    for e in fleet.engines
                                ],
                            )
                        )
                run["versions"] = versions(sync)
            run["events"] = [(ev.kind.name, ev.version) async for ev in events]
            seen[name] = run
            await anyio.to_thread.run_sync(dist.barrier)
        return seen
