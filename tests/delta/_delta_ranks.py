"""One rank of a 2-rank FSDP2 trainer (gloo) refitting an embedded engine with delta syncs.

Run as ``python _delta_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON``. Rank 0
holds the engine. Every rank runs a ``CollectiveWeightSynchronizer(delta=True)``:

1. a full sync (no baseline yet);
2. each rank changes a few elements of its shards and one whole tensor: a delta sync,
   whose bytes are the patches' (the same on both ranks' events);
3. rank 1's read fails after its last gather: every rank raises the same error;
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

from aiosync import CollectiveWeightSynchronizer, TrainCluster, VersionEventKind
from aiosync.delta import encode_patch
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from tests._support.fsdp2 import (
    ENGINE_SEED,
    FaultySource,
    build_sharded_model,
    full_state,
    init_process_group,
    versions,
    write_result,
)


def _patch_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    total = 0
    for name, tensor in new.items():
        patch = encode_patch(name, 0, old[name].reshape(-1).view(torch.int32), tensor)
        total += 0 if patch is None else patch.nbytes
    return total


def _nudge(model: torch.nn.Module) -> None:
    """Three elements of every rank's shard of each layer's ``q_proj``, and all of
    ``model.norm``: what a small optimizer step changes."""
    with torch.no_grad():
        for layer in model.model.layers:
            local = layer.self_attn.q_proj.weight.to_local()
            if local.numel():
                local.view(-1)[:3] += 0.5
        model.model.norm.weight.to_local().mul_(1.5)


async def _committed(sync: CollectiveWeightSynchronizer, events: Any) -> list[Any]:
    await sync.mark_stale()
    await sync.sync_weights()
    while True:
        event = await events.__anext__()
        if event.kind is VersionEventKind.COMMITTED:
            return [event.delta, event.nbytes]


async def run(rank: int, world: int, store_port: int) -> dict[str, Any]:
    model = build_sharded_model(world)
    source = FaultySource(DTensorRefitSource(model), rank, one_shot=True)
    seen: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        engine: EmbeddedEngine | None = None
        if rank == 0:
            engine = await stack.enter_async_context(
                EmbeddedEngine(TINY_QWEN3, num_workers=1, seed=ENGINE_SEED)
            )
        sync = CollectiveWeightSynchronizer(
            source,
            engine,
            train_cluster=TrainCluster(world_size=world, rank=rank, master_port=store_port),
            inference_world_size=1,
            bucket_bytes=16 * 1024,
            collective_timeout_s=30.0,
            sync_timeout_s=60.0,
            delta=True,
        )
        await stack.enter_async_context(sync)
        events = await stack.enter_async_context(sync.subscribe())

        async def holds() -> bool | None:
            want = full_state(source)  # every rank gathers
            if engine is None:
                return None
            [state] = await engine.hf_state_dicts()
            return all(torch.equal(state[n], t) for n, t in want.items())

        seen["full"] = await _committed(sync, events)
        state = full_state(source)
        seen["manifest_nbytes"] = sum(t.numel() * t.element_size() for t in state.values())
        before = full_state(source)
        _nudge(model)
        after = full_state(source)
        seen["expected_delta"] = _patch_bytes(before, after)
        seen["delta"] = await _committed(sync, events)
        seen["delta_holds"] = await holds()

        _nudge(model)
        # Rank 1's read fails after its last gather (the gathers stay paired, so the
        # same processes sync again): every rank raises, before any patch moves.
        source.fault = "after" if rank == 1 else None
        await sync.mark_stale()
        try:
            await sync.sync_weights()
            seen["failure"] = None
        except Exception as exc:
            seen["failure"] = [type(exc).__name__, str(exc)]
        seen["after_failure"] = versions(sync)
        seen["healed"] = await _committed(sync, events)
        seen["healed_holds"] = await holds()
        seen["after_heal"] = versions(sync)
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
