"""ShardedWeightSynchronizer(data_plane="mooncake") into a TP=2 embedded engine: the same
plan, its buckets moved by Mooncake writes over loopback TCP; each worker bit-exact with
its slices and greedy equal to the trainer. Skipped where Mooncake cannot run."""

from __future__ import annotations

import socket

import pytest
import torch

from aiosync import TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import TransportError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded import ShardedWeightSynchronizer
from aiosync.transports.sharded._mooncake import mooncake_available

_REASON = mooncake_available()
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
async def test_a_sharded_sync_over_mooncake_lands_each_slice_bit_exact() -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=41)
    async with EmbeddedEngine(
        TINY_QWEN3, num_workers=1, tensor_parallel_size=2, seed=5, rpc_timeout_s=120
    ) as engine:
        sync = ShardedWeightSynchronizer(
            DTensorRefitSource(trainer.model),
            engine,
            train_cluster=TrainCluster(master_port=_port()),
            inference_world_size=2,
            bucket_bytes=16 * 1024,
            collective_timeout_s=30.0,
            data_plane="mooncake",
        )
        async with sync:
            for step in range(2):
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.mul_(1.0 + 0.25 * step)
                await sync.mark_stale()
                await sync.sync_weights()
                full = trainer.hf_state_dict()
                for layout, state in zip(
                    await engine.weight_layouts(), await engine.hf_state_dicts(), strict=True
                ):
                    for name, tensor in full.items():
                        part = layout[name]
                        want = tensor.narrow(part.dim, part.start, part.length)
                        assert torch.equal(state[name], want), name
            assert [r["nbytes"] for r in sync.last_worker_results] == list(
                sync.transfer_plan.receiver_nbytes
            )
        await engine.prepare_for_generation()
        expected = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected


def test_mooncake_needs_gloo_and_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    source = DTensorRefitSource(HFModelRunner.from_config(TINY_QWEN3, seed=1).model)
    with pytest.raises(ValueError, match="needs dist_backend='gloo'"):
        ShardedWeightSynchronizer(
            source, None, train_cluster=TrainCluster(), inference_world_size=1,
            dist_backend="nccl", data_plane="mooncake",
        )  # fmt: skip
    from aiosync.transports.sharded import synchronizer

    monkeypatch.setattr(synchronizer, "mooncake_available", lambda: "not installed")
    with pytest.raises(TransportError, match="data_plane='mooncake': not installed"):
        ShardedWeightSynchronizer(
            source, None, train_cluster=TrainCluster(), inference_world_size=1,
            data_plane="mooncake",
        )  # fmt: skip
