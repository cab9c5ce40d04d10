"""A tensor-parallel Qwen3-MoE EmbeddedEngine in real processes (one replica, 2 ranks):
experts TP-sliced per expert, refit through IPC with per-expert checkpoint names."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from aiosync.engines.embedded.configs import TINY_QWEN3_MOE
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.layout import Part
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.steps import first_sync

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

MOE = TINY_QWEN3_MOE
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(MOE, tensor_parallel_size=2, seed=2, rpc_timeout_s=120) as engine:
        yield engine


async def test_moe_experts_are_sliced_per_expert_and_refit_bit_exact(
    engine: EmbeddedEngine,
) -> None:
    layouts = await engine.weight_layouts()
    for rank, layout in enumerate(layouts):
        expert = "model.layers.2.mlp.experts.3"
        assert layout[f"{expert}.gate_proj.weight"] == Part((32, 64), 0, 16 * rank, 16)
        assert layout[f"{expert}.down_proj.weight"] == Part((64, 32), 1, 16 * rank, 16)
        assert layout["model.layers.2.mlp.gate.weight"] == Part.whole((4, 64))
    trainer = HFModelRunner.from_config(MOE, seed=21)
    async with IPCWeightSynchronizer(
        DTensorRefitSource(trainer.model), engine, bucket_bytes=12288, rpc_timeout_s=60
    ) as sync:
        await first_sync(sync)
    full = trainer.hf_state_dict()
    for rank, (layout, state) in enumerate(
        zip(layouts, await engine.hf_state_dicts(), strict=True)
    ):
        assert list(state) == list(full)
        for name, tensor in full.items():
            part = layout[name]
            want = tensor.narrow(part.dim, part.start, part.length)
            assert torch.equal(state[name], want), f"worker {rank}: {name} differs"
    want_tokens = trainer.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == want_tokens
