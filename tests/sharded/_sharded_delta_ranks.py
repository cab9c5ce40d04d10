"""One rank of a 2-rank FSDP2 trainer (gloo) refitting a TP=2 embedded engine with delta syncs
on the shard-aware plan.

Run as ``python _sharded_delta_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON``. Rank 0
holds the engine (one replica, two tensor-parallel workers). Every rank runs a
``ShardedWeightSynchronizer(delta=True)``:

1. a full sync (no baseline yet);
2. each rank changes three elements of its shard of each layer's ``q_proj`` and all of
   ``model.norm``: a delta sync in which both ranks send patches (sparse boxes and dense
   ones), whose bytes are the boxes' (the same on both ranks' events);
3. rank 1's shard read fails in the next delta: every rank raises;
4. the next sync is a full one, and bit-exact.

Each rank writes what it saw to ``OUT_JSON``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync import TrainCluster, VersionEventKind
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded import ShardedWeightSynchronizer
from tests._support.delta import box_patch_bytes
from tests._support.fsdp2 import (
    ENGINE_SEED,
    build_sharded_model,
    init_process_group,
    versions,
    write_result,
)


def _nudge(model: torch.nn.Module) -> None:
    """Three elements of every rank's shard of each layer's ``q_proj``, and all of
    ``model.norm``: what a small optimizer step changes."""
    with torch.no_grad():
        for layer in model.model.layers:
            local = layer.self_attn.q_proj.weight.to_local()
            if local.numel():
                local.view(-1)[:3] += 0.5
        model.model.norm.weight.to_local().mul_(1.5)


async def _committed(sync: ShardedWeightSynchronizer, events: Any) -> list[Any]:
    await sync.mark_stale()
    await sync.sync_weights()
    while True:
        event = await events.__anext__()
        if event.kind is VersionEventKind.COMMITTED:
            return [event.delta, event.nbytes]


async def _slices_match(engine: EmbeddedEngine, full: dict[str, torch.Tensor]) -> list[bool]:
    """Per worker: whether every tensor it holds is exactly its part of ``full``."""
    seen = []
    for layout, state in zip(
        await engine.weight_layouts(), await engine.hf_state_dicts(), strict=True
    ):
        seen.append(
            all(
                torch.equal(
                    state[n],
                    t.narrow(layout[n].dim, layout[n].start, layout[n].length) if t.dim() else t,
                )
                for n, t in full.items()
            )
        )
    return seen


async def run(rank: int, world: int, store_port: int) -> dict[str, Any]:
    model = build_sharded_model(world)
    source = DTensorRefitSource(model)
    seen: dict[str, Any] = {"rank": rank}

    def full_state() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in source.iter_weights()}  # every rank gathers

    async with contextlib.AsyncExitStack() as stack:
        engine: EmbeddedEngine | None = None
        if rank == 0:
            engine = await stack.enter_async_context(
                EmbeddedEngine(TINY_QWEN3, num_workers=1, tensor_parallel_size=2, seed=ENGINE_SEED)
            )
        sync = ShardedWeightSynchronizer(
            source,
            engine,
            train_cluster=TrainCluster(world_size=world, rank=rank, master_port=store_port),
            inference_world_size=2,
            bucket_bytes=16 * 1024,
            collective_timeout_s=30.0,
            sync_timeout_s=60.0,
            delta=True,
        )
        await stack.enter_async_context(sync)
        events = await stack.enter_async_context(sync.subscribe())
        plan = sync.transfer_plan
        seen["total_nbytes"] = plan.total_nbytes

        # 1. full
        seen["full"] = await _committed(sync, events)

        # 2. both ranks send patches
        before = full_state()
        _nudge(model)
        after = full_state()
        seen["expected_delta"] = box_patch_bytes(plan, before, after)
        seen["delta"] = await _committed(sync, events)
        if engine is not None:
            seen["delta_bit_exact"] = await _slices_match(engine, after)
            seen["delta_by_sender"] = [r["by_sender"] for r in sync.last_worker_results]

        # 3. rank 1 fails to read its 2nd shard in the next delta
        _nudge(model)
        real = sync._sender_source

        def failing() -> Any:
            local = real()
            calls = [0]

            def get(name: str) -> torch.Tensor:
                calls[0] += 1
                if rank == 1 and calls[0] == 2:
                    raise RuntimeError("rank 1 could not read its shard")
                return local(name)

            return get

        sync._sender_source = failing  # type: ignore[method-assign]
        await sync.mark_stale()
        try:
            await sync.sync_weights()
            seen["failure"] = None
        except Exception as exc:
            seen["failure"] = [type(exc).__name__, str(exc)]
        seen["after_failure"] = versions(sync)
        sync._sender_source = real  # type: ignore[method-assign]

        # 4. full again, bit-exact
        seen["healed"] = await _committed(sync, events)
        seen["after_heal"] = versions(sync)
        healed = full_state()
        if engine is not None:
            seen["healed_bit_exact"] = await _slices_match(engine, healed)
        dist.barrier()
    return seen


def main() -> None:
    rank, world, port, store_port = (int(a) for a in sys.argv[1:5])
    out = Path(sys.argv[5])
    init_process_group(rank, world, port)
    try:
        seen = anyio.run(run, rank, world, store_port)
    finally:
        dist.destroy_process_group()
    write_result(out, seen)


if __name__ == "__main__":
    main()
