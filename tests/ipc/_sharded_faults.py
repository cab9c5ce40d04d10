"""One rank of an N-rank FSDP2 trainer (gloo) colocated with an N-worker embedded engine,
with a fault injected into one rank's second sync.

Run as ``python _sharded_faults.py RANK WORLD_SIZE PORT OUT_JSON SCENARIO``. Worker
``r`` stands for device ``cpu:r``, fed by trainer rank ``r``; rank 0 holds the
engine. Syncs: 1. a normal one; 2. the faulty one (``SCENARIO``); 3. a clean
one, which must heal (skipped by ``kill``, whose survivors exit; ``heal`` is a
restarted job's clean run). Scenarios, on the last rank (``FAULTY``):

- ``before``: its source raises before yielding its first tensor;
- ``between``: ... before its 5th tensor (index 4), between its gathers;
- ``after``: ... after yielding its last tensor (the others' gathers are over);
- ``offload``: its ``offload_after_refit`` raises, after every worker committed;
- ``kill``: it SIGKILLs itself before its 5th tensor;
- ``heal``: no fault (the 3 syncs are clean).

Each rank writes what it saw to ``OUT_JSON`` (the killed rank writes nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta
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
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.interfaces import RefitManifest
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
STEPS = 5
#: The limit of the whole sync, seconds (the survivors' errors must come within it).
SYNC_TIMEOUT_S = 60.0


class InjectedFault(RuntimeError):
    """The failure a test injects into one rank's source."""


class _Source(RefitSource):
    """A DTensor source whose ``fault`` (set per sync) fails this rank."""

    def __init__(self, inner: DTensorRefitSource) -> None:
        self.inner = inner
        self.fault: str | None = None

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner.iter_weights()):
            if (self.fault, i) in (("before", 0), ("between", 4)):
                raise InjectedFault(f"{self.fault}: the source failed at tensor {i}")
            if self.fault == "kill" and i == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item
        if self.fault == "after":
            raise InjectedFault("after: the source failed after its last tensor")

    def offload_after_refit(self) -> None:
        if self.fault == "offload":
            raise InjectedFault("offload: offload_after_refit failed")


def _versions(sync: IPCWeightSynchronizer) -> list[Any]:
    return [sync.policy_version, sync.weight_version, sync.is_stale]


async def _engine_state(engine: EmbeddedEngine) -> dict[str, Any]:
    """What the engine does now: its generation's outcome and every worker's status."""
    seen: dict[str, Any] = {}
    try:
        seen["generated"] = await engine.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True)
    except Exception as exc:
        seen["generate_error"] = [type(exc).__name__, str(exc)]
    status = await engine.status()
    seen["weights_valid"] = [w["weights_valid"] for w in status]
    return seen


async def run(rank: int, world: int, scenario: str) -> dict[str, Any]:
    torch.manual_seed(0)
    config = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "model_type"})
    model = Qwen3ForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = _Source(DTensorRefitSource(model))
    faulty = rank == world - 1
    seen: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    async with contextlib.AsyncExitStack() as stack:
        engine = None
        if rank == 0:
            engine = await stack.enter_async_context(
                EmbeddedEngine(
                    TINY_QWEN3,
                    num_workers=world,
                    seed=9,
                    device_labels=[f"cpu:{r}" for r in range(world)],
                )
            )
        sync = IPCWeightSynchronizer(
            source,
            engine,
            process_group=dist.group.WORLD,
            device_label=f"cpu:{rank}",
            bucket_bytes=64 * 1024,
            rpc_timeout_s=20.0,
            sync_timeout_s=SYNC_TIMEOUT_S,
        )
        await stack.enter_async_context(sync)
        await sync.init_communicator()

        # 1. a normal sync
        await sync.mark_stale()
        await sync.sync_weights()
        seen["after_ok"] = _versions(sync)

        # 2. the faulty one, with new weights
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.25)
        if faulty and scenario != "heal":
            source.fault = scenario
        await sync.mark_stale()
        try:
            await sync.sync_weights()
            seen["failure"] = None
        except Exception as exc:
            seen["failure"] = [type(exc).__name__, str(exc)]
        seen["after_failure"] = _versions(sync)
        source.fault = None
        if engine is not None:
            seen["engine_after_failure"] = await _engine_state(engine)
        if scenario == "kill":
            # The group lost a rank: the survivors exit (the test restarts the job).
            return seen

        # 3. a clean sync heals every worker
        await sync.sync_weights()
        seen["after_heal"] = _versions(sync)
        expected = {n: t.clone() for n, t in source.inner.iter_weights()}  # all ranks gather
        if engine is not None:
            trainer = HFModelRunner.from_config(TINY_QWEN3)
            trainer.load_weights(expected.items())
            seen["trainer_greedy"] = trainer.generate(
                PROMPTS, max_new_tokens=STEPS, ignore_eos=True
            )
            seen["engine_after_heal"] = await _engine_state(engine)
        dist.barrier()
    return seen


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, scenario = Path(sys.argv[4]), sys.argv[5]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=SYNC_TIMEOUT_S),
    )
    seen = anyio.run(run, rank, world, scenario)
    out.write_text(json.dumps(seen))
    if scenario != "kill":
        dist.destroy_process_group()
    # A group that lost a rank is not torn down: exiting must not wait for it.


if __name__ == "__main__":
    main()
