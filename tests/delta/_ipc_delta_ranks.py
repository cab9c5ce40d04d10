"""One rank of a 2-rank FSDP2 trainer (gloo) colocated with a 2-worker embedded engine,
refitting it with IPC delta syncs.

Run as ``python _ipc_delta_ranks.py RANK WORLD_SIZE PG_PORT OUT_JSON``. Worker ``r``
stands for device ``cpu:r``, rank ``r``'s; rank 0 holds the engine. Every rank runs
an ``IPCWeightSynchronizer(delta=True, process_group=WORLD)``:

1. a full sync (no baseline yet);
2. a few elements of every rank's shards change: a delta sync, each rank sending its
   own worker the patches (their bytes on each rank's event);
3. rank 1's read fails after its last gather: every rank raises;
4. the next sync is a full one, and every worker is bit-exact.

Each rank writes what it saw to ``OUT_JSON``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import anyio
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from _delta_ranks import _committed, _nudge, _patch_bytes

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.fsdp2 import (
    FaultySource,
    build_sharded_model,
    colocated_engine,
    engine_matches,
    full_state,
    init_process_group,
    versions,
    write_result,
)


async def run(rank: int, world: int) -> dict[str, Any]:
    model = build_sharded_model(world)
    source = FaultySource(DTensorRefitSource(model), rank, one_shot=True)
    seen: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        engine: EmbeddedEngine | None = None
        if rank == 0:
            engine = await stack.enter_async_context(colocated_engine(world))
        sync = IPCWeightSynchronizer(
            source,
            engine,
            process_group=dist.group.WORLD,
            device_label=f"cpu:{rank}",
            bucket_bytes=16 * 1024,
            rpc_timeout_s=30.0,
            delta=True,
        )
        await stack.enter_async_context(sync)
        events = await stack.enter_async_context(sync.subscribe())

        async def holds() -> list[bool] | None:
            want = full_state(source)  # every rank gathers
            return None if engine is None else await engine_matches(engine, want)

        seen["full"] = await _committed(sync, events)
        before = full_state(source)
        seen["manifest_nbytes"] = sum(t.numel() * t.element_size() for t in before.values())
        _nudge(model)
        seen["expected_delta"] = _patch_bytes(before, full_state(source))
        seen["delta"] = await _committed(sync, events)
        seen["delta_holds"] = await holds()
        if engine is not None:
            seen["took_patches"] = [r["delta"] for r in sync.last_worker_results]

        _nudge(model)
        source.fault = "after" if rank == 1 else None
        await sync.mark_stale()
        try:
            await sync.sync_weights()
            seen["failure"] = None
        except Exception as exc:
            seen["failure"] = type(exc).__name__
        seen["after_failure"] = versions(sync)
        seen["healed"] = await _committed(sync, events)
        seen["healed_holds"] = await holds()
        seen["after_heal"] = versions(sync)
        dist.barrier()
    return seen


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    out = Path(sys.argv[4])
    init_process_group(rank, world, port)
    try:
        seen = anyio.run(run, rank, world)
    finally:
        dist.destroy_process_group()
    write_result(out, seen)


if __name__ == "__main__":
    main()
