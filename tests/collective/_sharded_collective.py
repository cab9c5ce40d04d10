"""One rank of a sharded (FSDP2, gloo) trainer syncing into an embedded engine over the
collective transport, with a failure injected on one rank during the second sync.

Run as ``python _sharded_collective.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON
SCENARIO FAILED_RANK [probe]``. Rank 0 holds a 1-worker embedded engine. ``SCENARIO``:

* ``before``: rank ``FAILED_RANK``'s ``iter_weights`` raises before its first tensor
  (before any gather);
* ``between``: it raises before its 4th tensor (the other ranks sit in that gather);
* ``after``: it raises after its last tensor (every gather done);
* ``kill``: it SIGKILLs itself before its 4th tensor;
* ``heal``: no failure (a restarted job's clean run).

Sync 1 succeeds; sync 2 carries the failure; with ``after`` (the gathers stayed paired)
and ``heal`` sync 3 runs in the same processes and must heal. Each surviving rank writes
what it saw to ``OUT_JSON`` and returns from ``main``: the test checks that the process
exits (the failed rank waits for its stdin to close first). The failed rank writes the
moment its failure struck (``time.monotonic()``) to ``OUT_JSON`` with the suffix
``.fault``. With ``probe``, rank 0 also records what its engine does after sync 2
(``benchmarks/faults.py``). The trainer is :mod:`tests._support.fsdp2`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync import TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from tests._support import fsdp2

#: A short limit for a whole sync, seconds: every failure must be reported within it.
SYNC_TIMEOUT_S = 30.0
#: What ``probe`` generates after the failed sync.
PROMPTS = [[1, 2, 3, 4], [5, 6]]
STEPS = 5


class InjectedError(fsdp2.InjectedFault):
    """The failure a rank's source raises on purpose."""


class _Source(fsdp2.FaultySource):
    """A rank's FSDP2 source that fails (or dies) at one point of one sync when armed."""

    between_at = 3

    def error(self, fault: str, index: int | None) -> Exception:
        if index is None:
            return InjectedError(f"rank {self.rank} failed after its last tensor")
        return InjectedError(f"rank {self.rank} failed before tensor {index}")


async def run(
    rank: int,
    world: int,
    store_port: int,
    scenario: str,
    failed_rank: int,
    probe: bool,
    stamp: Path,
) -> dict[str, Any]:
    model = fsdp2.build_sharded_model(world)
    source = _Source(DTensorRefitSource(model), rank, one_shot=True, stamp=stamp)
    seen: dict[str, Any] = {"rank": rank}
    engine = EmbeddedEngine(TINY_QWEN3, num_workers=1, seed=9) if rank == 0 else None
    if engine is not None:
        await engine.start()
    sync = CollectiveWeightSynchronizer(
        source,
        engine,
        train_cluster=TrainCluster(world_size=world, rank=rank, master_port=store_port),
        inference_world_size=1,
        dist_backend="gloo",
        bucket_bytes=16 * 1024,
        sync_timeout_s=SYNC_TIMEOUT_S,
        collective_timeout_s=SYNC_TIMEOUT_S,
        rpc_timeout_s=SYNC_TIMEOUT_S,
    )
    try:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        seen["after_ok"] = fsdp2.versions(sync)

        fsdp2.advance_weights(model)
        if rank == failed_rank and scenario != "heal":
            source.fault = scenario
        await fsdp2.failed_sync_seen(sync, seen)  # (marks it stale first)
        if probe and engine is not None:
            seen["engine_after_failure"] = await fsdp2.engine_state(engine, PROMPTS, STEPS)

        if scenario in ("after", "heal"):
            await sync.sync_weights()
            seen["after_heal"] = fsdp2.versions(sync)
            expected = fsdp2.full_state(source)  # every rank gathers
            if engine is not None:
                await engine.prepare_for_generation()
                seen["healed_bit_exact"] = all(await fsdp2.engine_matches(engine, expected))
    finally:
        await sync.shutdown()
        if engine is not None:
            await engine.shutdown()
    return seen


def main() -> None:
    rank, world, pg_port, store_port = (int(a) for a in sys.argv[1:5])
    out, scenario, failed_rank = Path(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    probe = sys.argv[8:] == ["probe"]
    # The trainer's own group has a long limit (torch's default is 30 min): a gather
    # left waiting for a rank that failed must not be what ends the sync.
    fsdp2.init_process_group(rank, world, pg_port, timeout_s=1800)
    seen = anyio.run(
        run, rank, world, store_port, scenario, failed_rank, probe, out.with_suffix(".fault")
    )
    fsdp2.write_result(out, seen)
    if rank == failed_rank:
        # The failed rank stays until the test has seen the others exit (it closes our
        # stdin then): a gather a survivor left waiting for us ends when we leave, and
        # that must not coincide with the survivor's own interpreter shutdown.
        sys.stdin.read()
    # No destroy_process_group(): after a failed rank's gathers went missing, the
    # trainer's own group holds a gather that never completes (the trainer restarts).


if __name__ == "__main__":
    main()
