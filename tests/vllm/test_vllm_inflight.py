"""The in-flight policy on real vLLM: what ``pause_generation(mode)`` does to a request
that is generating when a sync starts, and what ``generate()`` does while paused.

One ``AsyncLLM`` for the module (vLLM's own pause: "abort", "wait", "keep") and the
session's ``vllm.LLM`` ("wait" only). The long request is greedy with ``ignore_eos``,
so its unpaused output is a fixed list of ``LONG_TOKENS`` tokens to compare against.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

import pytest_asyncio
from vllm_helpers import async_llm

from aiosync.engines.vllm.backend import VLLMGenerationBackend

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]

PROMPT = [1, 2, 3]
LONG_TOKENS = 200  # many decode steps: still running when the pause comes
STARTED_TOKENS = 4  # the pause comes once the long request has streamed this many
SHORT_TOKENS = 6
HELD_S = 0.5  # how long a test checks that something stays held

_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def async_backend(tiny_qwen3_dir: Path) -> AsyncIterator[VLLMGenerationBackend]:
    """An ``AsyncLLM`` of the tiny checkpoint (CPU, eager, 256 positions) behind the backend."""
    backend = VLLMGenerationBackend(async_llm(tiny_qwen3_dir, max_model_len=256))
    yield backend
    await backend.shutdown()
    # Drop the engine now: its __del__ shuts down again, which fails at interpreter exit.
    backend.engine = None
    gc.collect()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def unpaused_greedy(async_backend: VLLMGenerationBackend) -> list[int]:
    """The long request's output with nothing paused."""
    return (await async_backend.generate([PROMPT], max_new_tokens=LONG_TOKENS))[0]


class LongRequest:
    """``PROMPT`` through ``AsyncLLM.generate`` directly (for vLLM's finish reason),
    greedy, ``LONG_TOKENS`` tokens, ``ignore_eos``; ``tokens`` grows as they stream."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=PROMPT)
        async for out in self.engine.generate(prompt, params, f"long-{next(_ids)}"):
            self.tokens = list(out.outputs[0].token_ids)
            self.finish_reason = out.outputs[0].finish_reason
            if len(self.tokens) >= STARTED_TOKENS:
                self.started.set()

    async def running(self) -> LongRequest:
        await self.started.wait()
        assert not self.task.done()
        return self


async def test_abort_ends_the_running_request_now_with_a_prefix_of_its_greedy_output(
    async_backend: VLLMGenerationBackend, unpaused_greedy: list[int]
) -> None:
    engine = async_backend.engine
    long = await LongRequest(engine).running()
    await async_backend.pause_generation("abort")
    try:
        assert await engine.is_paused() is True
        await asyncio.wait_for(long.task, 5)
        assert long.finish_reason == "abort"
        assert STARTED_TOKENS <= len(long.tokens) < LONG_TOKENS
        assert long.tokens == unpaused_greedy[: len(long.tokens)]
    finally:
        await async_backend.resume_generation()
    assert await engine.is_paused() is False


async def test_wait_lets_the_running_request_finish_on_the_old_weights_before_returning(
    async_backend: VLLMGenerationBackend, unpaused_greedy: list[int]
) -> None:
    long = await LongRequest(async_backend.engine).running()
    await async_backend.pause_generation("wait")
    try:
        assert long.task.done()
        assert long.finish_reason == "length"
        assert long.tokens == unpaused_greedy
    finally:
        await async_backend.resume_generation()


async def test_keep_freezes_the_running_request_and_it_completes_unchanged_after_resume(
    async_backend: VLLMGenerationBackend, unpaused_greedy: list[int]
) -> None:
    long = await LongRequest(async_backend.engine).running()
    await async_backend.pause_generation("keep")  # clear_cache: its KV is dropped too
    try:
        frozen_at = len(long.tokens)
        await asyncio.sleep(HELD_S)
        assert not long.task.done()
        assert len(long.tokens) == frozen_at < LONG_TOKENS
    finally:
        await async_backend.resume_generation()
    await asyncio.wait_for(long.task, 120)
    # It recomputed its KV and went on: nothing lost, nothing repeated.
    assert long.finish_reason == "length"
    assert long.tokens == unpaused_greedy


async def test_generate_while_an_async_llm_is_paused_waits_for_the_resume(
    async_backend: VLLMGenerationBackend, unpaused_greedy: list[int]
) -> None:
    await async_backend.pause_generation("wait")
    held = asyncio.create_task(async_backend.generate([PROMPT], max_new_tokens=SHORT_TOKENS))
    try:
        await asyncio.sleep(HELD_S)
        assert not held.done()
        assert async_backend.generation_paused is True
    finally:
        await async_backend.resume_generation()
    assert await asyncio.wait_for(held, 60) == [unpaused_greedy[:SHORT_TOKENS]]
    assert async_backend.generation_paused is False


async def test_generate_held_by_a_pause_times_out_with_sync_timeout_error(
    async_backend: VLLMGenerationBackend,
) -> None:
    from aiosync.errors import SyncTimeoutError

    await async_backend.pause_generation("abort", clear_cache=False)
    try:
        with pytest.raises(SyncTimeoutError, match=r"waited 0.2 s .* paused for a sync"):
            await async_backend.generate([PROMPT], max_new_tokens=SHORT_TOKENS, timeout_s=0.2)
    finally:
        await async_backend.resume_generation()


async def test_an_unknown_mode_is_a_value_error_and_pauses_nothing(
    async_backend: VLLMGenerationBackend,
) -> None:
    with pytest.raises(
        ValueError, match=r"unknown in-flight mode 'drop'; known: \['abort', 'wait', 'keep'\]"
    ):
        await async_backend.pause_generation("drop")
    assert async_backend.generation_paused is False
    assert await async_backend.engine.is_paused() is False


# -- vllm.LLM (synchronous) ----------------------------------------------------------


async def test_llm_wait_drains_running_generate_calls_and_holds_new_ones(llm: Any) -> None:
    backend = VLLMGenerationBackend(llm)
    expected = (await backend.generate([PROMPT], max_new_tokens=64))[0]
    running = asyncio.create_task(backend.generate([PROMPT], max_new_tokens=64))
    await asyncio.sleep(0)  # it is past the gate, in vLLM's worker thread
    await backend.pause_generation("wait")
    try:
        assert running.done()
        assert running.result() == [expected]
        held = asyncio.create_task(backend.generate([PROMPT], max_new_tokens=SHORT_TOKENS))
        await asyncio.sleep(HELD_S)
        assert not held.done()
    finally:
        await backend.resume_generation()
    assert await asyncio.wait_for(held, 60) == [expected[:SHORT_TOKENS]]


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_llm_refuses_abort_and_keep_before_anything_changes(llm: Any, mode: str) -> None:
    backend = VLLMGenerationBackend(llm)
    with pytest.raises(
        NotImplementedError,
        match=rf"in-flight mode '{mode}' is not supported .* use 'wait', or an AsyncLLM",
    ):
        await backend.pause_generation(mode)
    assert backend.generation_paused is False
    assert len((await backend.generate([PROMPT], max_new_tokens=SHORT_TOKENS))[0]) == SHORT_TOKENS
