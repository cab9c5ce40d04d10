"""CollectiveWeightSynchronizer end to end: one trainer (this process) and spawned
inference workers over real gloo process groups on 127.0.0.1."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from collective_harness import QWEN3, QWEN3_MOE, WorkerPool, Workers

from aiosync import (
    RefitMismatchError,
    SyncTimeoutError,
    TrainCluster,
    TransportError,
    VersionEventKind,
)
from refit.torch_source import DTensorRefitSource
from transports.collective import CollectiveWeightSynchronizer
from transports.embedded.model import HFModelRunner

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4], [7, 9, 11]]


def _trainer(config: dict[str, object], seed: int = 100) -> HFModelRunner:
    return HFModelRunner.from_config(dict(config), seed=seed)


def _checkpoint(runner: HFModelRunner) -> dict[str, torch.Tensor]:
    """The trainer's weights as the refit source sends them."""
    return {n: t.clone() for n, t in DTensorRefitSource(runner.model).iter_weights()}


def _sync(
    runner: HFModelRunner, workers: Workers, port: int, **options: object
) -> CollectiveWeightSynchronizer:
    return CollectiveWeightSynchronizer(
        DTensorRefitSource(runner.model),
        workers,
        train_cluster=TrainCluster(master_port=port),
        inference_world_size=len(workers.indices),
        collective_timeout_s=60.0,
        rpc_timeout_s=60.0,
        **options,  # type: ignore[arg-type]
    )


def _perturb(runner: HFModelRunner, seed: int) -> None:
    """An optimizer step: every weight changes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in runner.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


async def _assert_bit_exact(
    pool: WorkerPool, indices: list[int], expected: dict[str, torch.Tensor]
) -> None:
    for i in indices:
        got = await pool.call(i, "test_state_dict")
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (i, name)


async def test_sync_one_worker_bit_exact_with_kv_scales_and_same_greedy_output(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3)
    workers = await pool.view([0])
    before = await pool.call(0, "test_state_dict")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[name], _checkpoint(trainer)[name])  # the sync must change it
    async with _sync(trainer, workers, free_port) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights(kv_scales={0: 0.5, 1: 0.25})
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (1, 1, False)
    await _assert_bit_exact(pool, [0], _checkpoint(trainer))
    assert await pool.call(0, "test_kv_scales") == {
        "model.layers.0.self_attn.k_scale": 0.5,
        "model.layers.0.self_attn.v_scale": 0.5,
        "model.layers.1.self_attn.k_scale": 0.25,
        "model.layers.1.self_attn.v_scale": 0.25,
    }
    expected = trainer.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    assert await pool.call(0, "test_generate", prompts=PROMPTS, max_new_tokens=6) == expected
