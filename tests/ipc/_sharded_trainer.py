"""One rank of a 2-rank FSDP2 trainer (gloo) colocated with a 2-worker embedded engine.

Run as ``python _sharded_trainer.py RANK WORLD_SIZE PORT OUT_JSON``. The engine's
workers stand for devices ``cpu:0`` and ``cpu:1``; trainer rank ``r`` is
``cpu:r``. Rank 0 holds the engine. Three syncs:

1. a normal sync (every worker bit-exact, each fed by its own rank only; each
   rank gathers every tensor straight into its bucket, so packing copies nothing);
2. worker 1 (rank 1's device) is killed mid-sync: every rank must fail alike;
3. after respawning it and re-initialising on every rank, a sync heals all.

Each rank writes what it saw to ``OUT_JSON``; the test compares the ranks. The
trainer is :mod:`tests._support.fsdp2`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support import fsdp2


async def run(rank: int, world: int) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    source = fsdp2.FaultySource(DTensorRefitSource(model), rank)
    seen: dict[str, Any] = {"rank": rank}
    async with contextlib.AsyncExitStack() as stack:
        engine, sync = await fsdp2.rank_sync(
            stack, "ipc", source, rank, world, 0, bucket_bytes=64 * 1024, rpc_timeout_s=10.0
        )
        assert isinstance(sync, IPCWeightSynchronizer)
        await sync.init_communicator()
        seen["peers"] = sync.peers

        # 1. a normal sync, traced: what packing copied on this rank
        sync.trace = True
        await sync.mark_stale()
        await sync.sync_weights()
        sync.trace = False
        seen["after_ok"] = fsdp2.versions(sync)
        assert sync.last_trace is not None and sync.plan is not None
        rows = sync.last_trace["trainer"]
        seen["packed"] = {
            "buckets": [len(rows), len(sync.plan.buckets)],
            "tensor_bytes": sync.plan.total_bytes,
            "copied": sum(row["copied"] for row in rows),
        }
        expected = fsdp2.full_state(source)  # all ranks gather
        if engine is not None:
            await engine.prepare_for_generation()
            seen["bit_exact"] = await fsdp2.engine_matches(engine, expected)
            seen["receives"] = await engine.collective_rpc("aiosync_ipc_last_receive")

        # 2. rank 1's worker dies mid-sync
        fsdp2.advance_weights(model)
        if engine is not None:
            victim = engine.pids[1]

            def kill(i: int) -> None:
                if i == 4:
                    os.kill(victim, signal.SIGKILL)

            source.on_tensor = kill
        await fsdp2.failed_sync_seen(sync, seen)
        source.on_tensor = None

        # 3. respawn, re-initialise on every rank, heal
        if engine is not None:
            seen["respawned"] = await engine.respawn_dead_workers()
        await sync.init_communicator()
        await sync.sync_weights()
        seen["after_heal"] = fsdp2.versions(sync)
        expected = fsdp2.full_state(source)
        if engine is not None:
            await engine.prepare_for_generation()
            seen["healed_bit_exact"] = await fsdp2.engine_matches(engine, expected)
        dist.barrier()
    return seen


if __name__ == "__main__":
    fsdp2.rank_main(run, store_ports=0)
