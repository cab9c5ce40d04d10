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

Each rank writes what it saw to ``OUT_JSON`` (the killed rank writes nothing); the
faulty rank writes the moment its fault struck (``time.monotonic()``) to
``OUT_JSON`` with the suffix ``.fault``. The trainer is :mod:`tests._support.fsdp2`'s.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support import fsdp2

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
STEPS = 5
#: The limit of the whole sync, seconds (the survivors' errors must come within it).
SYNC_TIMEOUT_S = 60.0


async def run(rank: int, world: int, scenario: str, stamp: Path) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    source = fsdp2.FaultySource(DTensorRefitSource(model), rank, stamp=stamp)
    faulty = rank == world - 1
    seen: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    async with contextlib.AsyncExitStack() as stack:
        limits = {"rpc_timeout_s": 20.0, "sync_timeout_s": SYNC_TIMEOUT_S}
        engine, sync = await fsdp2.rank_sync(
            stack, "ipc", source, rank, world, 0, bucket_bytes=64 * 1024, **limits
        )
        assert isinstance(sync, IPCWeightSynchronizer)
        await sync.init_communicator()

        # 1. a normal sync
        await sync.mark_stale()
        await sync.sync_weights()
        seen["after_ok"] = fsdp2.versions(sync)

        # 2. the faulty one, with new weights
        fsdp2.advance_weights(model)
        if faulty and scenario != "heal":
            source.fault = scenario
        await fsdp2.failed_sync_seen(sync, seen)
        source.fault = None
        if engine is not None:
            seen["engine_after_failure"] = await fsdp2.engine_state(engine, PROMPTS, STEPS)
        if scenario == "kill":
            # The group lost a rank: the survivors exit (the test restarts the job).
            return seen

        # 3. a clean sync heals every worker
        await sync.sync_weights()
        seen["after_heal"] = fsdp2.versions(sync)
        expected = fsdp2.full_state(source)  # all ranks gather
        if engine is not None:
            trainer = HFModelRunner.from_config(TINY_QWEN3)
            trainer.load_weights(expected.items())
            seen["trainer_greedy"] = trainer.generate(
                PROMPTS, max_new_tokens=STEPS, ignore_eos=True
            )
            seen["engine_after_heal"] = await fsdp2.engine_state(engine, PROMPTS, STEPS)
            seen["healed_bit_exact"] = await fsdp2.engine_matches(engine, expected)
        dist.barrier()
    return seen


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, scenario = Path(sys.argv[4]), sys.argv[5]
    fsdp2.init_process_group(rank, world, port, timeout_s=SYNC_TIMEOUT_S)
    seen = anyio.run(run, rank, world, scenario, out.with_suffix(".fault"))
    fsdp2.write_result(out, seen)
    if scenario != "kill":
        dist.destroy_process_group()
    # A group that lost a rank is not torn down: exiting must not wait for it.


if __name__ == "__main__":
    main()
