"""The same contract through vLLM's AsyncLLM (awaited directly, no worker thread):
refits by both transports change its greedy output exactly as the trainer's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import (
    NEW_TOKENS,
    PROMPTS,
    async_llm,
    gloo_collective,
    sync_and_generate,
    trainer_greedy,
)

from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _async_llm(model_dir: Path, **options: Any) -> Any:
    """An ``AsyncLLM`` of the tiny checkpoint with aiosync's worker extension (CPU, eager),
    ``max_model_len`` vLLM's default unless ``options`` name it."""
    return async_llm(model_dir, **{"max_model_len": None, **options})


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


async def test_async_llm_refits_by_both_transports_match_the_trainers_greedy_output(
    tiny_qwen3_dir: Path, free_port: Callable[[], int]
) -> None:
    from transformers import Qwen3ForCausalLM

    trainer = Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    engine = _async_llm(tiny_qwen3_dir, max_model_len=128)
    backend = VLLMGenerationBackend(engine)
    try:
        start = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert start == trainer_greedy(trainer)
        collective = gloo_collective(
            DTensorRefitSource(trainer),
            backend,
            free_port(),
            bucket_bytes=64 * 1024,
            verify=True,
        )
        async with collective:
            await collective.init_communicator()
            perturb(trainer, seed=11)
            after_collective = await sync_and_generate(collective, backend)
            assert collective.weight_version == 1
        assert after_collective == trainer_greedy(trainer)
        assert after_collective != start
        ipc = IPCWeightSynchronizer(
            DTensorRefitSource(trainer), backend, bucket_bytes=64 * 1024, device="cpu"
        )
        async with ipc:
            await ipc.init_communicator()
            perturb(trainer, seed=12)
            after_ipc = await sync_and_generate(ipc, backend)
            assert ipc.weight_version == 1
        assert after_ipc == trainer_greedy(trainer)
        assert after_ipc != after_collective
    finally:
        await backend.shutdown()


async def test_a_busy_engine_still_drops_its_prefix_cache_after_a_refit(
    tiny_qwen3_dir: Path,
) -> None:
    # vLLM's reset_prefix_cache() returns False (and does nothing) while requests hold
    # KV blocks; waking the KV cache must still drop every KV computed with old weights.
    import asyncio
    import itertools

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = _async_llm(tiny_qwen3_dir, max_model_len=256, enable_prefix_caching=True)
    backend = VLLMGenerationBackend(engine)
    ids = itertools.count()
    shared = [i % 120 + 1 for i in range(140)]  # more than one KV block (128 tokens on CPU)

    async def cached_tokens(prompt: list[int]) -> int:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        final = None
        async for out in engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, str(next(ids))
        ):
            final = out
        assert final is not None
        return int(final.num_cached_tokens or 0)

    running = asyncio.Event()

    async def long_request() -> int:
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        final = None
        prompt = TokensPrompt(prompt_token_ids=[1, 2, 3])
        async for out in engine.generate(prompt, params, "long"):
            final = out
            running.set()
        assert final is not None
        return len(final.outputs[0].token_ids)

    try:
        long = asyncio.create_task(long_request())
        await running.wait()  # it holds KV blocks now
        await cached_tokens(shared)
        if await cached_tokens(shared) == 0:
            pytest.skip("this vLLM build does not cache prefixes")
        assert await engine.reset_prefix_cache() is False  # refused while the request runs
        await backend.prepare_for_generation(["kv_cache"])  # preempts it, then resets
        assert await cached_tokens(shared) == 0  # nothing of the old cache survived
        assert await long == 120  # the preempted request resumes and finishes
    finally:
        await backend.shutdown()
