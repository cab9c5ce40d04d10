"""A sleeping engine on the collective transport (issue 25, item 4): its weights are
woken before the first byte lands, so that the wake (vLLM's level 1: weights restored
from CPU) cannot put the old weights back over the new ones, and after a level-2
sleep the engine gives back what the checkpoint does not carry (rotary buffers)."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from collective_harness import QWEN3

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from tests._support.builders import factory_pick

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


async def _sleep_then_sync(
    engine: EmbeddedEngine, trainer: HFModelRunner, overlap: Literal["inplace", "staged"]
) -> None:
    sync = factory_pick(
        DTensorRefitSource(trainer.model),
        engine,
        world_size=1,
        overlap=overlap,
        collective_timeout_s=60.0,
    )
    async with sync:
        await engine.finish_generation()  # sleeps at the engine's sleep_level
        await sync.mark_stale()
        await sync.sync_weights()
        await engine.prepare_for_generation()
        assert (sync.weight_version, sync.is_stale) == (1, False)


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
async def test_a_level1_sleeping_engine_is_woken_before_the_first_byte_and_serves_the_new_weights(
    overlap: Literal["inplace", "staged"],
) -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=300)
    async with EmbeddedEngine(dict(QWEN3), num_workers=1, seed=7, sleep_level=1) as engine:
        assert await engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True) != (
            trainer.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
        )
        await _sleep_then_sync(engine, trainer, overlap)
        # The wake restored the offloaded (old) weights before the refit loaded the new.
        assert await engine.collective_rpc("embedded_lifecycle") == [
            ["sleep(1)", "wake(weights)", "load", "wake(kv_cache)"]
        ]
        [state] = await engine.hf_state_dicts()
        expected = trainer.hf_state_dict()
        assert all(torch.equal(state[n], t) for n, t in expected.items())
        want = trainer.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
        assert await engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True) == want


async def test_a_level2_sleep_that_dropped_the_rotary_buffers_generates_like_the_trainer() -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=301)
    inv_freq = dict(trainer.model.named_buffers())["model.rotary_emb.inv_freq"]
    assert bool(inv_freq.ne(0).all())  # what the runner loses on a level-2 sleep
    async with EmbeddedEngine(
        dict(QWEN3),
        num_workers=1,
        seed=7,
        sleep_level=2,
        runner_factory="collective_sleep_runner.make",
    ) as engine:
        await _sleep_then_sync(engine, trainer, "inplace")
        assert await engine.collective_rpc("embedded_lifecycle") == [
            ["sleep(2)", "wake(weights)", "load", "wake(kv_cache)"]
        ]
        assert [s["weights_valid"] for s in await engine.status()] == [True]
        want = trainer.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
        assert await engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True) == want
