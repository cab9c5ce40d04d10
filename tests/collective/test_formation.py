"""A local set-up failure cancels the remote side of the sync group at once (issue 15).

When one side's part of forming the group fails (here: gloo bound to a network
interface that does not exist, as with a wrong ``GLOO_SOCKET_IFNAME``), the
ranks already waiting in the rendezvous for it must give up within moments with
a typed error, not after the whole formation limit; the weights the engine
holds stay valid and the next ``init_communicator()`` / sync succeeds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from collective_harness import PROMPTS, QWEN3, WorkerPool, Workers

from aiosync import TrainCluster, TransportError
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer

pytestmark = pytest.mark.slow

#: A network interface no machine has: gloo fails to create its device at once.
NO_SUCH_INTERFACE = "aiosync-nope0"
#: What the workers' rendezvous would otherwise wait for a rank that never comes, s.
COLLECTIVE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def formation_pool() -> Iterator[WorkerPool]:
    workers = WorkerPool([QWEN3, QWEN3], seed=1)
    try:
        yield workers
    finally:
        workers.close()


def _sync(trainer: HFModelRunner, workers: Workers) -> CollectiveWeightSynchronizer:
    return CollectiveWeightSynchronizer(
        DTensorRefitSource(trainer.model),
        workers,
        train_cluster=TrainCluster(),
        inference_world_size=len(workers.indices),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        rpc_timeout_s=COLLECTIVE_TIMEOUT_S,
    )


@contextlib.asynccontextmanager
async def _synced_once(
    pool: WorkerPool, seed: int
) -> AsyncIterator[tuple[HFModelRunner, Workers, CollectiveWeightSynchronizer]]:
    """A trainer (``seed``) synced once (version 1) into workers 0 and 1 of ``pool``."""
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=seed)
    workers = await pool.view([0, 1])
    async with _sync(trainer, workers) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        yield trainer, workers, sync


def _step(trainer: HFModelRunner, seed: int) -> None:
    """An optimizer step: every weight changes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


async def _assert_workers_hold(pool: WorkerPool, trainer: HFModelRunner) -> None:
    expected = dict(DTensorRefitSource(trainer.model).iter_weights())
    for i in (0, 1):
        got = await pool.call(i, "test_state_dict")
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (i, name)


async def _heals(
    sync: CollectiveWeightSynchronizer, pool: WorkerPool, trainer: HFModelRunner, version: int
) -> None:
    """The same synchronizer forms the group again and the next version lands bit-exact."""
    await sync.init_communicator()
    async with sync.policy_update():
        _step(trainer, seed=version)
    await sync.sync_weights()
    assert (sync.weight_version, sync.is_stale) == (version, False)
    await _assert_workers_hold(pool, trainer)


async def test_a_trainer_side_setup_failure_releases_the_workers_at_once(
    formation_pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _synced_once(formation_pool, 401) as (trainer, workers, sync):
        generated = await formation_pool.call(0, "test_generate", prompts=PROMPTS, max_new_tokens=4)

        # The trainer's own gloo set-up fails (the workers are fine): re-forming
        # the group fails on rank 0 after the workers were asked to join.
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", NO_SUCH_INTERFACE)
        start = time.monotonic()
        with pytest.raises(TransportError) as info:
            await sync.init_communicator()
        elapsed = time.monotonic() - start
        monkeypatch.delenv("GLOO_SOCKET_IFNAME")

        # Both sides came back (the workers' RPC included) well within the limit
        # they would otherwise wait in the rendezvous for rank 0.
        assert elapsed < COLLECTIVE_TIMEOUT_S / 2, elapsed
        assert NO_SUCH_INTERFACE in str(info.value)
        assert str(info.value).startswith("forming the sync group (gloo, 3 ranks): ")
        assert sorted(workers.last_errors) == [0, 1]
        for error in workers.last_errors.values():
            assert isinstance(error, TransportError)
            assert "forming the sync group (gloo, 3 ranks): cancelled: trainer rank 0 failed: " in (
                str(error)
            )
            assert NO_SUCH_INTERFACE in str(error)

        # Nothing moved: the version is kept and the engine keeps generating
        # with exactly the weights of version 1.
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await _assert_workers_hold(formation_pool, trainer)
        again = await formation_pool.call(0, "test_generate", prompts=PROMPTS, max_new_tokens=4)
        assert again == generated

        await _heals(sync, formation_pool, trainer, version=2)


async def test_a_worker_side_setup_failure_releases_the_trainer_and_other_workers_at_once(
    formation_pool: WorkerPool,
) -> None:
    async with _synced_once(formation_pool, 402) as (trainer, workers, sync):
        await formation_pool.call(
            1, "test_set_env", name="GLOO_SOCKET_IFNAME", value=NO_SUCH_INTERFACE
        )
        try:
            start = time.monotonic()
            with pytest.raises(TransportError) as info:
                await sync.init_communicator()
            elapsed = time.monotonic() - start
        finally:
            await formation_pool.call(1, "test_set_env", name="GLOO_SOCKET_IFNAME", value=None)

        assert elapsed < COLLECTIVE_TIMEOUT_S / 2, elapsed
        # The trainer's own wait (rank 0) and worker 0's were cancelled by worker 1's failure.
        assert "cancelled: inference rank 1 failed: " in str(info.value), info.value
        assert NO_SUCH_INTERFACE in str(info.value)
        cancelled, failed = workers.last_errors[0], workers.last_errors[1]
        assert isinstance(cancelled, TransportError) and isinstance(failed, TransportError)
        assert "cancelled: inference rank 1 failed: " in str(cancelled)
        assert NO_SUCH_INTERFACE in str(failed) and "cancelled" not in str(failed).split("\n")[0]

        assert (sync.weight_version, sync.is_stale) == (1, False)
        await _assert_workers_hold(formation_pool, trainer)
        await _heals(sync, formation_pool, trainer, version=2)
