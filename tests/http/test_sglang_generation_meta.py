"""SGLangHTTPBackend.generate_with_meta: the core ``Generation`` from a real test server.

The server (float32, its own process on 127.0.0.1) holds exactly the trainer's
weights after a sync; each logprob is checked against one full forward pass of
the trainer's transformers model over the prompt and the generated tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from aiosync import (
    EmbeddedEngine,
    EngineFleet,
    Generation,
    SGLangHTTPBackend,
    VLLMGenerationBackend,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.sglang import SGLangGeneration
from aiosync.refit import DTensorRefitSource
from aiosync.testing.sglang_server import serve_in_subprocess
from aiosync.transports.http import HTTPWeightSynchronizer
from tests._support.checks import full_forward_logprobs

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER_SEED = 2
TRAINER_SEED = 21
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
STEPS = 10
ATOL = 1e-5


def _trainer_model() -> torch.nn.Module:
    items = dict(TINY_QWEN3)
    config = AutoConfig.for_model(items.pop("model_type"), **items)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TRAINER_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[SimpleNamespace]:
    model = _trainer_model()
    async with (
        serve_in_subprocess(TINY_QWEN3, seed=SERVER_SEED, dtype="float32") as url,
        SGLangHTTPBackend(url) as backend,
        HTTPWeightSynchronizer(DTensorRefitSource(model), backend) as sync,
    ):
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        yield SimpleNamespace(backend=backend, sync=sync, model=model)


async def test_greedy_logprobs_and_version_come_back_in_sglangs_shape(
    env: SimpleNamespace,
) -> None:
    results = await env.backend.generate_with_meta(
        PROMPTS, max_new_tokens=STEPS, ignore_eos=True, logprobs=True
    )
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert isinstance(result, SGLangGeneration) and isinstance(result, Generation)
        expected, argmax = full_forward_logprobs(env.model, prompt, result.token_ids)
        assert result.token_ids == argmax and result.output_ids == argmax
        assert result.logprobs == pytest.approx(expected, abs=ATOL, rel=0)
        # SGLang's shape: [logprob, token_id, text (None without return_text_in_logprobs)].
        entries = result.meta_info["output_token_logprobs"]
        assert [(e[1], e[2]) for e in entries] == [(t, None) for t in result.token_ids]
        assert [e[0] for e in entries] == result.logprobs
        assert (result.first_version, result.last_version, result.version_change_at) == (
            1,
            1,
            None,
        )
        assert (result.aborted, result.finish_reason, result.weight_version) == (
            False,
            "length",
            "1",
        )
        # SGLang 0.5.23's per-token spans: every token computed under "1".
        assert result.meta_info["weight_versions"] == [{"version": "1", "start": 0, "end": STEPS}]


async def test_logprobs_are_not_asked_unless_wanted(env: SimpleNamespace) -> None:
    results = await env.backend.generate_with_meta(PROMPTS, max_new_tokens=4, ignore_eos=True)
    assert [r.logprobs for r in results] == [None, None]
    assert all("output_token_logprobs" not in r.meta_info for r in results)
    assert [r.token_ids for r in results] == await env.backend.generate(
        PROMPTS, max_new_tokens=4, ignore_eos=True
    )


async def test_seeded_sampling_repeats_and_reports_raw_logprobs(env: SimpleNamespace) -> None:
    kwargs: dict[str, Any] = {
        "max_new_tokens": STEPS,
        "temperature": 1.5,
        "top_p": 0.9,
        "seed": 3,
        "ignore_eos": True,
        "logprobs": True,
    }
    first = await env.backend.generate_with_meta(PROMPTS, **kwargs)
    again = await env.backend.generate_with_meta(PROMPTS, **kwargs)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    for prompt, result in zip(PROMPTS, first, strict=True):
        expected, _ = full_forward_logprobs(env.model, prompt, result.token_ids)
        assert result.logprobs == pytest.approx(expected, abs=ATOL, rel=0)


async def test_bad_sampling_parameters_are_refused_before_any_request(
    env: SimpleNamespace,
) -> None:
    with pytest.raises(ValueError, match="top_p"):
        await env.backend.generate_with_meta(PROMPTS, max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        await env.backend.generate_with_meta(PROMPTS, max_new_tokens=0)


async def test_an_answer_labelled_newer_than_the_request_spans_both_versions() -> None:
    # Real SGLang labels the answer only: a refit between request and answer
    # (a "keep" request, or one that waited through the sync) counts as both.
    answer = {
        "output_ids": [5, 6],
        "meta_info": {"weight_version": "4", "finish_reason": {"type": "length", "length": 2}},
    }
    result = SGLangGeneration.from_answer(answer, submitted_version=3)
    assert (result.first_version, result.last_version, result.version_change_at) == (3, 4, None)
    assert result.spans_versions is True
    same = SGLangGeneration.from_answer(answer, submitted_version=4)
    assert (same.first_version, same.last_version, same.spans_versions) == (4, 4, False)
    initial = SGLangGeneration.from_answer(
        {"output_ids": [1], "meta_info": {"weight_version": "default"}}
    )
    assert (initial.first_version, initial.last_version) == (None, None)


async def test_an_answer_labelled_by_a_restarted_trainers_lower_version_spans_both() -> None:
    # Case C27: the request went in under the previous owner's 4; a restarted
    # trainer (versions from 0) committed 2 before the answer. Versions need not grow.
    answer = {"output_ids": [5, 6], "meta_info": {"weight_version": "2"}}
    result = SGLangGeneration.from_answer(answer, submitted_version=4, spanned=True)
    assert (result.first_version, result.last_version, result.version_change_at) == (4, 2, None)
    assert result.spans_versions is True


async def test_every_engine_takes_one_generation_signature() -> None:
    # generate_with_meta(prompts, params=None, **keywords) on every engine: one
    # SamplingParams, or its fields as keywords, resolved by one adapter.
    for engine in (EmbeddedEngine, SGLangHTTPBackend, VLLMGenerationBackend, EngineFleet):
        params = list(inspect.signature(engine.generate_with_meta).parameters.values())
        assert [p.name for p in params[:3]] == ["self", "prompts", "params"], engine.__name__
        assert params[2].default is None, engine.__name__
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD, engine.__name__
