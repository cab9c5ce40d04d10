"""Edge cases of the collective transport (issue 15): zero-size tensors and zero-byte
buckets (C17), a broken tie (C19), a busy or OS-picked store port."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest
import torch
from collective_harness import QWEN3, RecordingWorkers, WorkerPool, Workers
from torch import nn

from aiosync import TrainCluster, TransportError
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer

pytestmark = pytest.mark.slow

#: Every tensor has zero elements: embedding and head (0, 0), norm (0,), no layers.
ALL_EMPTY = {**QWEN3, "vocab_size": 0, "hidden_size": 0, "num_hidden_layers": 0}
#: An empty vocabulary and MLP: the first bucket (the embedding) has zero bytes.
EMPTY_VOCAB_AND_MLP = {**QWEN3, "vocab_size": 0, "intermediate_size": 0}
#: Pool layout: 0 all empty, 1 empty vocabulary and MLP, 2 plain (untied) Qwen3.
CONFIGS = [ALL_EMPTY, EMPTY_VOCAB_AND_MLP, QWEN3]


@pytest.fixture(scope="module")
def edge_pool() -> Iterator[WorkerPool]:
    workers = WorkerPool(CONFIGS, seed=1)
    try:
        yield workers
    finally:
        workers.close()


def _sync(
    model: nn.Module, workers: Workers, cluster: TrainCluster, **options: object
) -> CollectiveWeightSynchronizer:
    return CollectiveWeightSynchronizer(
        DTensorRefitSource(model),
        workers,
        train_cluster=cluster,
        inference_world_size=len(workers.indices),
        collective_timeout_s=60.0,
        rpc_timeout_s=60.0,
        **options,  # type: ignore[arg-type]
    )


async def _assert_worker_holds(pool: WorkerPool, i: int, model: nn.Module) -> None:
    expected = dict(DTensorRefitSource(model).iter_weights())
    got = await pool.call(i, "test_state_dict")
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
async def test_a_manifest_of_only_zero_size_tensors_commits(
    edge_pool: WorkerPool, overlap: str
) -> None:
    trainer = HFModelRunner.from_config(dict(ALL_EMPTY), seed=31)
    workers = await edge_pool.view([0])
    async with _sync(trainer.model, workers, TrainCluster(), overlap=overlap, verify=True) as sync:
        assert [(b.nbytes, len(b.slots)) for b in sync.plan.buckets] == [(0, 3)]
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert [r["nbytes"] for r in sync.last_worker_results] == [0]
    await _assert_worker_holds(edge_pool, 0, trainer.model)


async def test_a_zero_byte_bucket_before_real_ones_commits_bit_exact(edge_pool: WorkerPool) -> None:
    trainer = HFModelRunner.from_config(dict(EMPTY_VOCAB_AND_MLP), seed=32)
    workers = await edge_pool.view([1])
    async with _sync(
        trainer.model, workers, TrainCluster(), bucket_bytes=4096, verify=True
    ) as sync:
        first = sync.plan.buckets[0]
        assert (first.nbytes, [s.name for s in first.slots]) == (0, ["model.embed_tokens.weight"])
        assert all(b.nbytes > 0 for b in sync.plan.buckets[1:])
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
    await _assert_worker_holds(edge_pool, 1, trainer.model)


async def test_a_broken_tie_sends_the_drifted_head_to_an_engine_that_has_one(
    edge_pool: WorkerPool,
) -> None:
    # C19: the trainer's config ties lm_head but its head is a tensor of its own
    # whose values drifted; the engine (untied) has lm_head.weight: it gets them.
    trainer = HFModelRunner.from_config({**QWEN3, "tie_word_embeddings": True}, seed=33)
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    head = nn.Parameter(model.model.embed_tokens.weight.detach() + 0.25)
    model.lm_head.weight = head
    workers = await edge_pool.view([2])
    async with _sync(model, workers, TrainCluster()) as sync:
        assert "lm_head.weight" in sync.plan.manifest()
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
    got = await edge_pool.call(2, "test_state_dict")
    assert torch.equal(got["lm_head.weight"], head)
    assert torch.equal(got["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    await _assert_worker_holds(edge_pool, 2, model)


async def test_a_busy_port_fails_at_once_without_asking_the_workers(
    edge_pool: WorkerPool,
) -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=34)
    workers = RecordingWorkers(await edge_pool.view([2]))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sync = _sync(trainer.model, workers, TrainCluster(master_port=port))
        with pytest.raises(TransportError) as info:
            async with sync:  # initializes: the port is taken
                pass
    assert str(info.value) == (
        f"sync-group store at 127.0.0.1:{port}: the port is already in use (EADDRINUSE); "
        "choose another TrainCluster.master_port, or 0 to let the OS pick a free one"
    )
    # Nothing was asked of the engine, so nothing waits on a rendezvous that cannot happen.
    assert workers.methods == []
    assert sync.weight_version == 0


async def test_the_default_cluster_picks_a_free_port_and_says_which(
    edge_pool: WorkerPool, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=35)
    workers = await edge_pool.view([2])
    sync = _sync(trainer.model, workers, TrainCluster())
    assert TrainCluster().master_port == 0
    assert sync.master_port is None  # not bound yet
    with caplog.at_level(logging.INFO, logger="aiosync.transports.collective.synchronizer"):
        async with sync:
            port = sync.master_port
            assert port is not None and port > 0
            # The port is really taken: the store listens on it.
            with socket.socket() as probe, pytest.raises(OSError):
                probe.bind(("127.0.0.1", port))
            await sync.mark_stale()
            await sync.sync_weights()
            assert sync.weight_version == 1
    assert sync.master_port == port
    assert [r.getMessage() for r in caplog.records] == [
        f"sync-group store listening on 127.0.0.1:{port} "
        "(picked by the OS: TrainCluster.master_port=0)"
    ]
    await _assert_worker_holds(edge_pool, 2, trainer.model)


@pytest.mark.parametrize(
    ("cluster", "error", "message"),
    [
        ({"world_size": 2, "rank": 1}, ValueError, "master_port=0 .* needs world_size == 1"),
        ({"master_port": 65536}, ValueError, "master_port must be in 0..65535, got 65536"),
        ({"master_port": -1}, ValueError, "master_port must be in 0..65535, got -1"),
        ({"master_port": "29600"}, TypeError, "master_port must be an int, got str"),
        ({"master_port": True}, TypeError, "master_port must be an int, got bool"),
    ],
)
def test_train_cluster_refuses_ports_it_cannot_use(
    cluster: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TrainCluster(**cluster)  # type: ignore[arg-type]
    # Several ranks with one port chosen for all of them are fine.
    assert TrainCluster(world_size=2, rank=1, master_port=29600).master_port == 29600
