"""Several trainer ranks, one engine (issue 13, item 5): only the source joins the
engine's sync group; the other ranks take part in the gathers and agree with the
source, so every rank ends a sync with the same versions, or the same error.

That contract is the conformance kit's ``sharded_trainer`` cell (``collective`` case);
here what is the collective's own: only the source joins the engine's group."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
import torch
from collective_harness import QWEN3, RecordingWorkers, WorkerPool

from aiosync import RefitMismatchError, TrainCluster
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer

pytestmark = pytest.mark.slow


class FlakySource(RefitSource):
    """A rank's real source that can drift from its manifest at one tensor (as a
    rank whose gather produced the wrong shape would)."""

    def __init__(self, runner: HFModelRunner) -> None:
        self.inner = DTensorRefitSource(runner.model)
        self.fail_next = False

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, tensor) in enumerate(self.inner.iter_weights()):
            if i == 5 and self.fail_next:
                self.fail_next = False
                yield name, tensor[:1]
                continue
            yield name, tensor


async def _on_every_rank(syncs: list[CollectiveWeightSynchronizer], method: str) -> list[object]:
    """Call ``method`` on every rank at once; each rank's result or exception."""
    out: list[object] = [None] * len(syncs)

    async def one(i: int) -> None:
        try:
            await getattr(syncs[i], method)()
        except Exception as exc:
            out[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(syncs)):
            tg.start_soon(one, i)
    return out


async def test_a_failure_on_a_non_source_rank_fails_every_rank_alike_and_the_next_sync_heals(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=120)
    workers = RecordingWorkers(await pool.view([0, 1]))
    sources = [FlakySource(trainer) for _ in range(2)]
    syncs = [
        CollectiveWeightSynchronizer(
            sources[rank],
            workers,
            train_cluster=TrainCluster(world_size=2, rank=rank, master_port=free_port),
            inference_world_size=2,
            collective_timeout_s=60.0,
        )
        for rank in (0, 1)
    ]
    try:
        assert await _on_every_rank(syncs, "init_communicator") == [None, None]
        # The engine's group: the source and the 2 workers; rank 1 is in none of it.
        assert [s.world_size for s in syncs] == [3, 3]
        assert syncs[1]._group is None  # type: ignore[attr-defined]
        for sync in syncs:
            await sync.mark_stale()

        sources[1].fail_next = True
        errors = await _on_every_rank(syncs, "sync_weights")
        assert [type(e) for e in errors] == [RefitMismatchError, RefitMismatchError]
        # Rank 1 raises its own error; the source raises it too, naming rank 1.
        assert str(errors[0]) == f"trainer rank 1: {errors[1]}"
        assert [(s.weight_version, s.is_stale) for s in syncs] == [(0, True), (0, True)]
        # The workers voted with the source after rank 1 reported: they refuse to generate.
        for i in (0, 1):
            with pytest.raises(Exception, match="weights invalid"):
                await pool.call(i, "test_generate", prompts=[[1, 2, 3]], max_new_tokens=2)

        assert await _on_every_rank(syncs, "sync_weights") == [None, None]
        assert [(s.weight_version, s.is_stale) for s in syncs] == [(1, False), (1, False)]
        assert syncs[0].plan.digest == syncs[1].plan.digest  # every rank planned alike
        expected = {n: t.clone() for n, t in DTensorRefitSource(trainer.model).iter_weights()}
        for i in (0, 1):
            got = await pool.call(i, "test_state_dict")
            assert all(torch.equal(got[n], t) for n, t in expected.items())
        # Only the source ever spoke to the engine.
        assert workers.methods.count("aiosync_collective_init") == 2  # first form + re-form
    finally:
        for sync in syncs:
            await sync.shutdown()
