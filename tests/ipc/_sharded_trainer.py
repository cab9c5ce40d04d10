"""One rank of a 2-rank FSDP2 trainer (gloo) colocated with a 2-worker embedded engine.

Run as ``python _sharded_trainer.py RANK WORLD_SIZE PORT OUT_JSON``. The engine's
workers stand for devices ``cpu:0`` and ``cpu:1``; trainer rank ``r`` is
``cpu:r``. Rank 0 holds the engine. Three syncs:

1. a normal sync (every worker bit-exact, each fed by its own rank only);
2. worker 1 (rank 1's device) is killed mid-sync: every rank must fail alike;
3. after respawning it and re-initialising on every rank, a sync heals all.

Each rank writes what it saw to ``OUT_JSON``; the test compares the ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync import RefitSource
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.interfaces import RefitManifest
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer


class _Source(RefitSource):
    def __init__(self, inner: DTensorRefitSource) -> None:
        self.inner = inner
        self.on_tensor = lambda i: None

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner.iter_weights()):
            self.on_tensor(i)
            yield item


def _versions(sync: IPCWeightSynchronizer) -> list[Any]:
    return [sync.policy_version, sync.weight_version, sync.is_stale]


async def _check_engine(engine: EmbeddedEngine, expected: dict[str, torch.Tensor]) -> list[bool]:
    return [
        list(state) == list(expected) and all(torch.equal(state[n], expected[n]) for n in state)
        for state in await engine.hf_state_dicts()
    ]


async def run(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "model_type"})
    model = Qwen3ForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = _Source(DTensorRefitSource(model))
    seen: dict[str, Any] = {"rank": rank}
    async with contextlib.AsyncExitStack() as stack:
        engine = None
        if rank == 0:
            engine = await stack.enter_async_context(
                EmbeddedEngine(TINY_QWEN3, num_workers=2, seed=9, device_labels=["cpu:0", "cpu:1"])
            )
        sync = IPCWeightSynchronizer(
            source,
            engine,
            process_group=dist.group.WORLD,
            device_label=f"cpu:{rank}",
            bucket_bytes=64 * 1024,
            rpc_timeout_s=10.0,
        )
        await stack.enter_async_context(sync)
        await sync.init_communicator()
        seen["peers"] = sync.peers

        # 1. a normal sync
        await sync.mark_stale()
        await sync.sync_weights()
        seen["after_ok"] = _versions(sync)
        expected = {n: t.clone() for n, t in source.inner.iter_weights()}  # all ranks gather
        if engine is not None:
            await engine.prepare_for_generation()
            seen["bit_exact"] = await _check_engine(engine, expected)
            seen["receives"] = await engine.collective_rpc("aiosync_ipc_last_receive")

        # 2. rank 1's worker dies mid-sync
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.25)
        if engine is not None:
            victim = engine.pids[1]

            def kill(i: int) -> None:
                if i == 4:
                    os.kill(victim, signal.SIGKILL)

            source.on_tensor = kill
        await sync.mark_stale()
        try:
            await sync.sync_weights()
            seen["failure"] = None
        except Exception as exc:
            seen["failure"] = [type(exc).__name__, str(exc)]
        seen["after_failure"] = _versions(sync)
        source.on_tensor = lambda i: None

        # 3. respawn, re-initialise on every rank, heal
        if engine is not None:
            seen["respawned"] = await engine.respawn_dead_workers()
        await sync.init_communicator()
        await sync.sync_weights()
        seen["after_heal"] = _versions(sync)
        expected = {n: t.clone() for n, t in source.inner.iter_weights()}
        if engine is not None:
            await engine.prepare_for_generation()
            seen["healed_bit_exact"] = await _check_engine(engine, expected)
        dist.barrier()
    return seen


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        seen = anyio.run(run, rank, world)
    finally:
        dist.destroy_process_group()
    out.write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
