"""One rank of a 2-rank FSDP2 trainer (gloo) refitting an embedded engine with delta syncs.

Run as ``python _delta_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON TRANSPORT``.
Rank 0 holds the engine: with ``collective``, one worker, rank 0 the source of a
``CollectiveWeightSynchronizer(delta=True)``; with ``ipc``, colocated, worker ``r``
standing for device ``cpu:r``, rank ``r``'s, every rank an
``IPCWeightSynchronizer(delta=True, process_group=WORLD)`` feeding its own worker:

1. a full sync (no baseline yet);
2. each rank changes a few elements of its shards and one whole tensor: a delta sync,
   whose bytes are the patches' (the same on both ranks' events);
3. rank 1's read fails after its last gather: every rank raises;
4. the next sync is a full one, and every worker is bit-exact.

Each rank writes what it saw to ``OUT_JSON``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync.refit import DTensorRefitSource
from tests._support import fsdp2
from tests._support.delta import committed, patch_bytes

#: Each transport's limits of one step (the IPC's RPCs, the collective's operations).
TIMEOUTS = {
    "collective": {"collective_timeout_s": 30.0, "sync_timeout_s": 60.0},
    "ipc": {"rpc_timeout_s": 30.0},
}


async def run(rank: int, world: int, store_port: int, transport: str) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    source = fsdp2.FaultySource(DTensorRefitSource(model), rank, one_shot=True)
    seen: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        options = {"bucket_bytes": 16 * 1024, "delta": True, **TIMEOUTS[transport]}
        engine, sync = await fsdp2.rank_sync(
            stack, transport, source, rank, world, store_port, **options
        )
        events = await stack.enter_async_context(sync.subscribe())

        async def holds() -> list[bool] | None:
            want = fsdp2.full_state(source)  # every rank gathers
            return None if engine is None else await fsdp2.engine_matches(engine, want)

        seen["full"] = await committed(sync, events)
        before = fsdp2.full_state(source)
        seen["manifest_nbytes"] = sum(t.numel() * t.element_size() for t in before.values())
        fsdp2.nudge(model)
        seen["expected_delta"] = patch_bytes(before, fsdp2.full_state(source))
        seen["delta"] = await committed(sync, events)
        seen["delta_holds"] = await holds()
        if engine is not None and transport == "ipc":
            seen["took_patches"] = [r["delta"] for r in sync.last_worker_results]  # type: ignore[attr-defined]

        fsdp2.nudge(model)
        # Rank 1's read fails after its last gather (the gathers stay paired, so the
        # same processes sync again): every rank raises, before any patch moves.
        source.fault = "after" if rank == 1 else None
        seen["failure"] = await fsdp2.failed_sync(sync)
        seen["after_failure"] = fsdp2.versions(sync)
        seen["healed"] = await committed(sync, events)
        seen["healed_holds"] = await holds()
        seen["after_heal"] = fsdp2.versions(sync)
        dist.barrier()
    return seen


if __name__ == "__main__":
    fsdp2.rank_main(run)
