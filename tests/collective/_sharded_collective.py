"""One rank of a sharded (FSDP2, gloo) trainer syncing into an embedded engine over the
collective transport, with a failure injected on one rank during the second sync.

Run as ``python _sharded_collective.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON
SCENARIO FAILED_RANK``. Rank 0 holds a 1-worker embedded engine. ``SCENARIO``:

* ``before``: rank ``FAILED_RANK``'s ``iter_weights`` raises before its first tensor
  (before any gather);
* ``between``: it raises before its 4th tensor (the other ranks sit in that gather);
* ``after``: it raises after its last tensor (every gather done);
* ``kill``: it SIGKILLs itself before its 4th tensor.

Sync 1 succeeds; sync 2 carries the failure; with ``after`` (the gathers stayed paired)
sync 3 runs in the same processes and must heal. Each surviving rank writes what it
saw to ``OUT_JSON`` and returns from ``main``: the test checks that the process exits
(the failed rank waits for its stdin to close first).
"""

from __future__ import annotations

import datetime
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

from aiosync import RefitSource, TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.interfaces import RefitManifest
from aiosync.refit import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer

#: A short limit for a whole sync, seconds: every failure must be reported within it.
SYNC_TIMEOUT_S = 30.0


class InjectedError(RuntimeError):
    """The failure a rank's source raises on purpose."""


class _Source(RefitSource):
    """A rank's FSDP2 source that fails (or dies) at one point when armed."""

    def __init__(self, inner: DTensorRefitSource, rank: int) -> None:
        self.inner = inner
        self.rank = rank
        self.armed: str | None = None

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        scenario, self.armed = self.armed, None
        for i, item in enumerate(self.inner.iter_weights()):
            if (scenario, i) in (("before", 0), ("between", 3)):
                raise InjectedError(f"rank {self.rank} failed before tensor {i}")
            if scenario == "kill" and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item
        if scenario == "after":
            raise InjectedError(f"rank {self.rank} failed after its last tensor")


def _versions(sync: CollectiveWeightSynchronizer) -> list[Any]:
    return [sync.policy_version, sync.weight_version, sync.is_stale]


async def run(
    rank: int, world: int, store_port: int, scenario: str, failed_rank: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    config = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "model_type"})
    model = Qwen3ForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = _Source(DTensorRefitSource(model), rank)
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
        seen["after_ok"] = _versions(sync)

        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.25)
        await sync.mark_stale()
        if rank == failed_rank:
            source.armed = scenario
        try:
            await sync.sync_weights()
            seen["failure"] = None
        except Exception as exc:
            seen["failure"] = [type(exc).__name__, str(exc)]
        seen["after_failure"] = _versions(sync)

        if scenario == "after":
            await sync.sync_weights()
            seen["after_heal"] = _versions(sync)
            expected = {n: t.clone() for n, t in source.inner.iter_weights()}  # every rank gathers
            if engine is not None:
                await engine.prepare_for_generation()
                [state] = await engine.hf_state_dicts()
                seen["healed_bit_exact"] = list(state) == list(expected) and all(
                    torch.equal(state[n], t) for n, t in expected.items()
                )
    finally:
        await sync.shutdown()
        if engine is not None:
            await engine.shutdown()
    return seen


def main() -> None:
    rank, world, pg_port, store_port = (int(a) for a in sys.argv[1:5])
    out, scenario, failed_rank = Path(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    # The trainer's own group has a long limit (torch's default is 30 min): a gather
    # left waiting for a rank that failed must not be what ends the sync.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{pg_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    seen = anyio.run(run, rank, world, store_port, scenario, failed_rank)
    out.write_text(json.dumps(seen))
    if rank == failed_rank:
        # The failed rank stays until the test has seen the others exit (it closes our
        # stdin then): a gather a survivor left waiting for us ends when we leave, and
        # that must not coincide with the survivor's own interpreter shutdown.
        sys.stdin.read()
    # No destroy_process_group(): after a failed rank's gathers went missing, the
    # trainer's own group holds a gather that never completes (the trainer restarts).


if __name__ == "__main__":
    main()
