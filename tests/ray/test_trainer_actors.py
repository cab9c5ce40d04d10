"""Two FSDP2 trainer ranks (gloo), each a Ray actor, refit a fleet of two engine actors:
the sync group meets at rank 0's node IP (Ray's) and a port rank 0 chose, passed to
rank 1 through Ray; the broadcast and the many-senders transport both land every
tensor on both engines bit for bit, and each engine generates the trainer's greedy
tokens, with the same versions and events on both ranks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from aiosync.engines.embedded.configs import TINY_QWEN3

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


async def test_two_trainer_actors_refit_a_fleet_of_two_engine_actors(
    ray_cluster: Any, h: SimpleNamespace
) -> None:
    from aiosync.ray import EngineSpec, launch_engine
    from tests.ray._trainers import RUNS, TrainerRank

    ray = ray_cluster
    engines = [
        await launch_engine(
            EngineSpec.embedded(TINY_QWEN3, seed=h.ENGINE_SEED + i),
            colocated=False,
            num_gpus=0,
            num_cpus=0,
        )
        for i in range(2)
    ]
    rank_class = ray.remote(num_cpus=0)(TrainerRank)
    ranks = [rank_class.remote(r, 2) for r in range(2)]
    try:
        # Rank 0 chooses where each group meets; Ray hands the results to both ranks.
        group = ranks[0].address.remote()
        sync_groups = [ranks[0].address.remote() for _ in RUNS]
        handles = [e.actor for e in engines]
        with anyio.fail_after(600):
            zero, one = [
                await ref
                for ref in [
                    rank.run.remote(group, handles if r == 0 else None, *sync_groups)
                    for r, rank in enumerate(ranks)
                ]
            ]
    finally:
        for rank in ranks:
            ray.kill(rank)
        for engine in engines:
            await engine.shutdown()
    addresses = [(a.host, a.port) for a in await anyio.to_thread.run_sync(ray.get, sync_groups)]
    assert zero["addresses"] == one["addresses"] == addresses
    assert all(host == "127.0.0.1" for host, _ in addresses)  # rank 0's node IP, Ray's view
    assert len({port for _, port in addresses}) == len(RUNS)
    for name, sharded, base in RUNS:
        a, b = zero[name], one[name]
        assert (
            a["class"]
            == b["class"]
            == ("ShardedWeightSynchronizer" if sharded else "CollectiveWeightSynchronizer")
        )
        assert a["versions"] == b["versions"] == [base + 2, base + 2, False]
        assert (
            a["events"]
            == b["events"]
            == [
                ("STALE", base + 1),
                ("SYNC_STARTED", base + 1),
                ("COMMITTED", base + 1),
                ("STALE", base + 2),
                ("SYNC_STARTED", base + 2),
                ("COMMITTED", base + 2),
            ]
        )
        assert a["holds"] == [[True, True], [True, True]]
        for trainer, per_engine in a["greedy"]:
            assert per_engine == [trainer, trainer]
        assert b["holds"] == b["greedy"] == []
