"""One rank of a 2-rank FSDP2 trainer (gloo) refitting a TP=2 embedded engine shard to slice.

Run as ``python _sharded_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON MODE``. Rank
0 holds the engine (one replica, two tensor-parallel workers). Every rank runs a
:class:`~aiosync.transports.sharded.ShardedWeightSynchronizer` (``delta=True`` in the
``delta`` mode). ``MODE`` ``plain``:

1. a sync: each rank sends its own FSDP2 shards; each worker gets only its slices;
2. a sync in which rank 1's shard read fails at its 5th tensor: every rank raises;
3. a clean sync, in the same processes, heals.

``delta``:

1. a full sync (no baseline yet);
2. each rank changes three elements of its shard of each layer's ``q_proj`` and all of
   ``model.norm``: a delta sync in which both ranks send patches (sparse boxes and dense
   ones), whose bytes are the boxes' (the same on both ranks' events);
3. rank 1's shard read fails at its 2nd tensor in the next delta: every rank raises;
4. the next sync is a full one, and bit-exact.

Each rank writes what it saw to ``OUT_JSON``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded import ShardedWeightSynchronizer
from tests._support import fsdp2
from tests._support.delta import box_patch_bytes, committed


@dataclass
class Rank:
    """What a mode's steps work with on one rank: the exit stack, the synchronizer, the
    engine (rank 0's; None elsewhere), the rank, ``full()`` (every rank gathers the
    trainer's full tensors), the FSDP2 model and what the rank saw."""

    stack: contextlib.AsyncExitStack
    sync: ShardedWeightSynchronizer
    engine: EmbeddedEngine | None
    rank: int
    full: Callable[[], dict[str, torch.Tensor]]
    model: torch.nn.Module
    seen: dict[str, Any]


async def plain(r: Rank) -> None:
    sync, engine, rank, full, model, seen = r.sync, r.engine, r.rank, r.full, r.model, r.seen
    plan = sync.transfer_plan
    seen["sender_nbytes"] = list(plan.sender_nbytes)
    seen["receiver_nbytes"] = list(plan.receiver_nbytes)

    # 1. every rank sends its own shards
    await sync.mark_stale()
    await sync.sync_weights()
    seen["after_ok"] = fsdp2.versions(sync)
    state = full()
    seen["manifest_nbytes"] = sum(t.numel() * t.element_size() for t in state.values())
    if engine is not None:
        seen["bit_exact"] = await fsdp2.slices_match(engine, state)
        seen["by_sender"] = [r["by_sender"] for r in sync.last_worker_results]
        seen["slice_nbytes"] = [
            sum(p.numel * state[n].element_size() for n, p in layout.items())
            for layout in await engine.weight_layouts()
        ]

    # 2. rank 1 fails to read its 5th shard
    fsdp2.advance_weights(model)
    with fsdp2.failing_shard_read(sync, rank, fails=1, at=5):
        seen["failure"] = await fsdp2.failed_sync(sync)
    seen["after_failure"] = fsdp2.versions(sync)
    if engine is not None:
        try:
            await engine.generate([[1, 2, 3]], max_new_tokens=2)
            seen["generate_after_failure"] = None
        except Exception as exc:
            seen["generate_after_failure"] = type(exc).__name__

    # 3. heal
    await sync.sync_weights()
    seen["after_heal"] = fsdp2.versions(sync)
    healed = full()
    if engine is not None:
        seen["healed_bit_exact"] = await fsdp2.slices_match(engine, healed)


async def delta(r: Rank) -> None:
    stack, sync, engine, rank, full, model, seen = (
        r.stack,
        r.sync,
        r.engine,
        r.rank,
        r.full,
        r.model,
        r.seen,
    )
    events = await stack.enter_async_context(sync.subscribe())

    # 1. full
    seen["full"] = await committed(sync, events)

    # 2. both ranks send patches
    before = full()
    fsdp2.nudge(model)
    after = full()
    seen["expected_delta"] = box_patch_bytes(sync.transfer_plan, before, after)
    seen["delta"] = await committed(sync, events)
    if engine is not None:
        seen["delta_bit_exact"] = await fsdp2.slices_match(engine, after)
        seen["delta_by_sender"] = [r["by_sender"] for r in sync.last_worker_results]

    # 3. rank 1 fails to read its 2nd shard in the next delta
    fsdp2.nudge(model)
    with fsdp2.failing_shard_read(sync, rank, fails=1, at=2):
        seen["failure"] = await fsdp2.failed_sync(sync)
    seen["after_failure"] = fsdp2.versions(sync)

    # 4. full again, bit-exact
    seen["healed"] = await committed(sync, events)
    seen["after_heal"] = fsdp2.versions(sync)
    healed = full()
    if engine is not None:
        seen["healed_bit_exact"] = await fsdp2.slices_match(engine, healed)


async def run(rank: int, world: int, store_port: int, mode: str) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    source = DTensorRefitSource(model)
    seen: dict[str, Any] = {"rank": rank}

    def full() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in source.iter_weights()}  # every rank gathers

    async with contextlib.AsyncExitStack() as stack:
        limits = {"collective_timeout_s": 30.0, "sync_timeout_s": 60.0}
        engine, sync = await fsdp2.rank_sync(
            stack, "sharded", source, rank, world, store_port, delta=mode == "delta", **limits
        )
        assert isinstance(sync, ShardedWeightSynchronizer)
        seen["total_nbytes"] = sync.transfer_plan.total_nbytes
        scenario = delta if mode == "delta" else plain
        await scenario(Rank(stack, sync, engine, rank, full, model, seen))
        dist.barrier()
    return seen


if __name__ == "__main__":
    fsdp2.rank_main(run)
