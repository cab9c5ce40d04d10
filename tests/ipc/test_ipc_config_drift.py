"""IPC refuses an engine whose model config drifted in a field that keeps the shapes."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync import EmbeddedEngine, RefitMismatchError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.configs import SMALL_QWEN3 as SMALL


@pytest.mark.slow
async def test_a_drifted_rope_theta_is_refused_at_init_and_the_same_config_syncs() -> None:
    torch.manual_seed(0)
    trainer = Qwen3ForCausalLM(Qwen3Config(**SMALL))
    drifted = {**Qwen3Config(**SMALL, rope_parameters={"rope_theta": 5e5}).to_dict()}
    async with EmbeddedEngine(drifted, dtype="float32") as engine:
        (before,) = await engine.hf_state_dicts()
        with pytest.raises(RefitMismatchError) as info:
            async with IPCWeightSynchronizer(DTensorRefitSource(trainer), engine, device="cpu"):
                pytest.fail("init must refuse the drifted engine")
        message = str(info.value)
        assert "rope_parameters.rope_theta: trainer 10000.0, engine 500000.0" in message
        (after,) = await engine.hf_state_dicts()
        assert all(torch.equal(before[n], after[n]) for n in before)
    async with (
        EmbeddedEngine(Qwen3Config(**SMALL).to_dict(), dtype="float32") as engine,
        IPCWeightSynchronizer(DTensorRefitSource(trainer), engine, device="cpu") as sync,
    ):
        await sync.mark_stale()
        await sync.sync_weights()
        (state,) = await engine.hf_state_dicts()
        expected = dict(DTensorRefitSource(trainer).iter_weights())
        assert all(torch.equal(state[n], t) for n, t in expected.items())
