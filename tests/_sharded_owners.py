"""One rank of a 2-rank FSDP2 trainer (gloo) whose engine another synchronizer takes over.

Run as ``python _sharded_owners.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON
TRANSPORT`` (``ipc``: colocated, a 2-worker engine paired by device label;
``collective``: a 1-worker engine, rank 0 the source). Rank 0 holds the engine:

1. trainer A (every rank) syncs version 1;
2. on rank 0, synchronizer B (another owner, a single-process trainer with other
   weights) syncs into the same engine (IPC), or is refused while A's sync group lives
   on the engine's workers (collective: then A keeps the engine and 3. succeeds);
3. every rank of A steps and calls ``refit_if_stale``: every rank must raise the same
   ``OwnershipError`` (rank 1 naming rank 0), none of them hang in the source's gathers;
4. every rank re-initialises A (the take-over): every rank is stale, and a sync lands
   A's weights on every worker;
5. a restarted A' (new synchronizers, ``initial_version=7``) on an engine that serves A's
   weights: every rank starts stale, the first sync labels the engine 7, the next step's 8.

Each rank writes what it saw to ``OUT_JSON``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from aiosync import TrainCluster, WeightSynchronizer, refit_if_stale
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.testing import StateDictSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support import fsdp2


def _make(
    transport: str,
    source: Any,
    engine: EmbeddedEngine | None,
    rank: int,
    world: int,
    store_port: int,
    **options: Any,
) -> WeightSynchronizer:
    limits = {"collective_timeout_s": 60.0} if transport == "collective" else {}
    return fsdp2.make_synchronizer(
        transport,
        source,
        engine,
        rank,
        world,
        store_port,
        bucket_bytes=64 * 1024,
        **limits,
        **options,
    )


async def run(rank: int, world: int, store_port: int, transport: str) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    source = DTensorRefitSource(model)
    seen: dict[str, Any] = {"rank": rank}
    async with contextlib.AsyncExitStack() as stack:
        engine: EmbeddedEngine | None = None
        if rank == 0:
            engine = await stack.enter_async_context(fsdp2.make_engine(transport, world))
        a = await stack.enter_async_context(
            _make(transport, source, engine, rank, world, store_port)
        )
        # 1. A syncs.
        await a.mark_stale()
        await a.sync_weights()
        seen["a_synced"] = fsdp2.versions(a)

        # 2. B takes the engine (rank 0's process only).
        if engine is not None:
            other = HFModelRunner.from_config(dict(TINY_QWEN3), seed=77).hf_state_dict()
            b_source = StateDictSource(other)
            b: WeightSynchronizer = (
                IPCWeightSynchronizer(b_source, engine, bucket_bytes=64 * 1024)
                if transport == "ipc"
                else CollectiveWeightSynchronizer(
                    b_source,
                    engine,
                    train_cluster=TrainCluster(master_port=0),
                    inference_world_size=1,
                    collective_timeout_s=60.0,
                )
            )
            try:
                async with b:
                    await b.mark_stale()
                    await b.sync_weights()
                seen["b_error"] = None
            except Exception as exc:  # the collective: A's sync group is A's while A lives
                seen["b_error"] = [type(exc).__name__, str(exc)]
            seen["b_owns"] = await fsdp2.engine_matches(engine, other)
        dist.barrier()
        # What a rank says before its next sync: only a single-process trainer turns stale.
        seen["a_after_takeover"] = fsdp2.versions(a)

        # 3. A steps; every rank's refit is refused alike.
        fsdp2.advance_weights(model)
        await a.mark_stale()
        try:
            await refit_if_stale(a)
            seen["refused"] = None
        except Exception as exc:
            seen["refused"] = [type(exc).__name__, str(exc)]
        seen["a_refused"] = fsdp2.versions(a)

        # 4. A takes the engine back: stale on every rank, and its sync lands.
        await a.init_communicator()
        seen["a_reinit_stale"] = a.is_stale
        seen["a_refit"] = await refit_if_stale(a)
        seen["a_healed"] = fsdp2.versions(a)
        expected = {n: t.clone() for n, t in source.iter_weights()}  # every rank gathers
        if engine is not None:
            seen["a_bit_exact"] = await fsdp2.engine_matches(engine, expected)
        await a.shutdown()

        # 5. A restarted trainer resumes at step 7 on the engine A left.
        resumed = await stack.enter_async_context(
            _make(transport, source, engine, rank, world, store_port + 1, initial_version=7)
        )
        seen["resumed_start"] = fsdp2.versions(resumed)
        seen["resumed_refit"] = await refit_if_stale(resumed)
        seen["resumed"] = fsdp2.versions(resumed)
        fsdp2.advance_weights(model)
        await resumed.mark_stale()
        await refit_if_stale(resumed)
        seen["resumed_stepped"] = fsdp2.versions(resumed)
        if engine is not None:
            seen["engine_version"] = engine.weight_version
        dist.barrier()
    return seen


if __name__ == "__main__":
    fsdp2.rank_main(run)
