"""One rank of a 2-rank FSDP2 trainer (gloo) refitting a TP=2 embedded engine shard to slice.

Run as ``python _sharded_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON``. Rank 0
holds the engine (one replica, two tensor-parallel workers). Every rank runs a
:class:`~aiosync.transports.sharded.ShardedWeightSynchronizer`:

1. a sync: each rank sends its own FSDP2 shards; each worker gets only its slices;
2. a sync in which rank 1's shard read fails at its 5th tensor: every rank raises;
3. a clean sync, in the same processes, heals.

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

from aiosync import TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded import ShardedWeightSynchronizer
from tests._support.fsdp2 import (
    ENGINE_SEED,
    advance_weights,
    build_sharded_model,
    init_process_group,
    versions,
    write_result,
)


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
        )
        await stack.enter_async_context(sync)
        plan = sync.transfer_plan
        seen["sender_nbytes"] = list(plan.sender_nbytes)
        seen["receiver_nbytes"] = list(plan.receiver_nbytes)
        seen["total_nbytes"] = plan.total_nbytes

        # 1. every rank sends its own shards
        await sync.mark_stale()
        await sync.sync_weights()
        seen["after_ok"] = versions(sync)
        full = {n: t.clone() for n, t in source.iter_weights()}  # every rank gathers
        seen["manifest_nbytes"] = sum(t.numel() * t.element_size() for t in full.values())
        if engine is not None:
            seen["bit_exact"] = await _slices_match(engine, full)
            seen["by_sender"] = [r["by_sender"] for r in sync.last_worker_results]
            seen["slice_nbytes"] = [
                sum(p.numel * full[n].element_size() for n, p in layout.items())
                for layout in await engine.weight_layouts()
            ]

        # 2. rank 1 fails to read its 5th shard
        advance_weights(model)
        real = sync._sender_source

        def failing() -> Any:
            local = real()
            calls = [0]

            def get(name: str) -> torch.Tensor:
                calls[0] += 1
                if rank == 1 and calls[0] == 5:
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
        if engine is not None:
            try:
                await engine.generate([[1, 2, 3]], max_new_tokens=2)
                seen["generate_after_failure"] = None
            except Exception as exc:
                seen["generate_after_failure"] = type(exc).__name__

        # 3. heal
        sync._sender_source = real  # type: ignore[method-assign]
        await sync.sync_weights()
        seen["after_heal"] = versions(sync)
        full = {n: t.clone() for n, t in source.iter_weights()}
        if engine is not None:
            seen["healed_bit_exact"] = await _slices_match(engine, full)
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
