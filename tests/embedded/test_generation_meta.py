"""EmbeddedEngine.generate_with_meta: the core ``Generation`` (logprobs, versions, finish reason).

Each logprob is checked against an independent computation: one full forward
pass of the transformers model (no KV cache) over the prompt and the generated
tokens, ``torch.log_softmax`` of the float32 logits at every generated position.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync import EngineFleet, Generation
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine, EmbeddedGeneration
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import SyncTimeoutError, TransportError

pytestmark = pytest.mark.asyncio(loop_scope="module")

SEED = 4
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
STEPS = 12
#: float32: the KV-cached decode and one full forward add in another order.
ATOL = 1e-5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(TINY_QWEN3, num_workers=1, seed=SEED, rpc_timeout_s=120) as engine:
        yield engine


@pytest.fixture(scope="module")
def trainer() -> torch.nn.Module:
    """The trainer's transformers model (the same seeded init as the engine's)."""
    return HFModelRunner.from_config(TINY_QWEN3, seed=SEED).model.eval()


def full_forward_logprobs(
    model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]
) -> tuple[list[float], list[int]]:
    """``(logprob of each token, greedy argmax at each position)`` from one forward
    pass over ``prompt + tokens``: ``log_softmax`` of the float32 logits."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    logp = torch.log_softmax(logits, dim=-1)
    values = [float(logp[p, t]) for p, t in zip(positions, tokens, strict=True)]
    argmax = [int(torch.argmax(logits[p])) for p in positions]
    return values, argmax


async def test_greedy_logprobs_equal_the_trainers_log_softmax(
    engine: EmbeddedEngine, trainer: torch.nn.Module
) -> None:
    results = await engine.generate_with_meta(
        PROMPTS, max_new_tokens=STEPS, ignore_eos=True, logprobs=True
    )
    assert [type(r) for r in results] == [EmbeddedGeneration] * len(PROMPTS)
    assert all(isinstance(r, Generation) for r in results)
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected, argmax = full_forward_logprobs(trainer, prompt, result.token_ids)
        assert result.token_ids == argmax  # greedy, token for token
        assert result.logprobs is not None and len(result.logprobs) == STEPS
        assert result.logprobs == pytest.approx(expected, abs=ATOL, rel=0)
        assert all(x <= 0 for x in result.logprobs)
        assert (result.aborted, result.finish_reason) == (False, "length")
        # Never synced: the engine's initial weights carry no version.
        assert (result.first_version, result.last_version, result.version_change_at) == (
            None,
            None,
            None,
        )
        assert result.versions == [None] * STEPS
        assert result.spans_versions is False


async def test_logprobs_are_none_unless_asked(engine: EmbeddedEngine) -> None:
    plain = await engine.generate_with_meta(PROMPTS, max_new_tokens=4, ignore_eos=True)
    asked = await engine.generate_with_meta(
        PROMPTS, max_new_tokens=4, ignore_eos=True, logprobs=True
    )
    assert [r.logprobs for r in plain] == [None, None]
    assert [r.token_ids for r in plain] == [r.token_ids for r in asked]
    assert [r.token_ids for r in plain] == await engine.generate(
        PROMPTS, max_new_tokens=4, ignore_eos=True
    )


async def test_sampled_logprobs_are_the_raw_distributions_before_temperature(
    engine: EmbeddedEngine, trainer: torch.nn.Module
) -> None:
    kwargs = {"max_new_tokens": STEPS, "temperature": 1.7, "seed": 5, "ignore_eos": True}
    first = await engine.generate_with_meta(PROMPTS, logprobs=True, **kwargs)
    again = await engine.generate_with_meta(PROMPTS, logprobs=True, **kwargs)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]  # seeded
    for prompt, result in zip(PROMPTS, first, strict=True):
        expected, _ = full_forward_logprobs(trainer, prompt, result.token_ids)
        assert result.logprobs == pytest.approx(expected, abs=ATOL, rel=0)


async def test_a_tiny_top_p_keeps_only_the_most_probable_token(engine: EmbeddedEngine) -> None:
    greedy = await engine.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True)
    nucleus = await engine.generate_with_meta(
        PROMPTS, max_new_tokens=STEPS, temperature=1.0, top_p=1e-6, seed=1, ignore_eos=True
    )
    assert [r.token_ids for r in nucleus] == greedy


async def test_results_carry_the_committed_weight_version(engine: EmbeddedEngine) -> None:
    await engine.on_weights_committed(7)
    (result,) = await engine.generate_with_meta([PROMPTS[0]], max_new_tokens=5, ignore_eos=True)
    assert result.versions == [7] * 5
    assert (result.first_version, result.last_version, result.version_change_at) == (7, 7, None)
    assert result.spans_versions is False


async def test_an_idle_pause_is_kept_by_the_engine_and_the_version_travels_with_requests(
    engine: EmbeddedEngine,
) -> None:
    await engine.on_weights_committed(8)
    await engine.pause_generation("wait")
    waiting = asyncio.create_task(
        engine.generate_with_meta([PROMPTS[0]], max_new_tokens=5, ignore_eos=True)
    )
    try:
        # Nothing ran when it paused: the workers were never told, the call waits here.
        (status,) = await engine.status()
        assert (status["paused"], status["requests"], waiting.done()) == (None, [], False)
        await engine.on_weights_committed(9)  # as a sync does while paused
    finally:
        await engine.resume_generation()
    (result,) = await waiting
    assert result.versions == [9] * 5
    # A request sent before a sync but arriving after it (the engine's earlier
    # commit) never relabels newer weights, whatever its version number.
    commit = engine._label()[0]  # type: ignore[index]
    await engine.collective_rpc("embedded_set_weight_version", ([commit - 1, 30],))
    (status,) = await engine.status()
    assert status["weight_version"] == 9


async def test_a_pause_after_an_abandoned_generate_reaches_the_request_still_running(
    engine: EmbeddedEngine,
) -> None:
    running = asyncio.create_task(
        engine.generate_with_meta([PROMPTS[0]], max_new_tokens=2000, ignore_eos=True)
    )
    with anyio.fail_after(60):
        while not (await engine.status())[0]["requests"]:
            await anyio.sleep(0.01)
    running.cancel()  # given up here; the worker still decodes it
    with pytest.raises(asyncio.CancelledError):
        await running
    await engine.pause_generation("abort")
    try:
        (status,) = await engine.status()
        assert (status["paused"], status["requests"]) == ("abort", [])
    finally:
        await engine.resume_generation()
    (status,) = await engine.status()
    assert status["paused"] is None


async def test_shutdown_fails_a_generate_waiting_on_a_pause_at_once() -> None:
    engine = await EmbeddedEngine.start_engine(TINY_QWEN3, num_workers=1, rpc_timeout_s=60)
    try:
        await engine.pause_generation("wait")
        waiting = asyncio.create_task(engine.generate([PROMPTS[0]], max_new_tokens=2))
        await anyio.sleep(0.05)
        assert not waiting.done()
    finally:
        await engine.shutdown()
    with anyio.fail_after(5), pytest.raises(TransportError, match="shut down"):
        await waiting


async def test_a_generate_waiting_on_a_pause_keeps_one_time_limit(
    engine: EmbeddedEngine,
) -> None:
    await engine.pause_generation("wait")
    try:
        call = asyncio.create_task(
            engine.generate([PROMPTS[0]], max_new_tokens=2000, ignore_eos=True, timeout_s=1.0)
        )
        await anyio.sleep(0.9)
    finally:
        await engine.resume_generation()
    # 0.1 s left of its limit: not enough for 2000 tokens; it fails, not runs another 1 s.
    with pytest.raises(SyncTimeoutError):
        await call
    await engine.pause_generation("abort")  # ends the request it gave up
    await engine.resume_generation()


async def test_a_fleet_passes_the_generation_keywords_and_answers_generations(
    engine: EmbeddedEngine,
) -> None:
    fleet = EngineFleet([engine])
    through_fleet = await fleet.generate_with_meta(
        PROMPTS, max_new_tokens=6, ignore_eos=True, logprobs=True
    )
    direct = await engine.generate_with_meta(
        PROMPTS, max_new_tokens=6, ignore_eos=True, logprobs=True
    )
    assert through_fleet == direct
    assert all(r.logprobs is not None and len(r.logprobs) == 6 for r in through_fleet)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": -0.5}, "temperature"),
        ({"max_new_tokens": 2, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 2, "top_p": 1.5}, "top_p"),
    ],
)
async def test_bad_sampling_parameters_are_refused_before_any_worker_is_asked(
    engine: EmbeddedEngine, kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await engine.generate_with_meta(PROMPTS, **kwargs)  # type: ignore[arg-type]


async def test_a_request_that_samples_eos_finishes_with_stop() -> None:
    # The engine's model as-is, with its third greedy token made the EOS token.
    reference = HFModelRunner.from_config(TINY_QWEN3, seed=SEED)
    (greedy,) = reference.generate([PROMPTS[0]], max_new_tokens=6, ignore_eos=True)
    eos = greedy[2]
    stop_at = greedy.index(eos) + 1
    config = {**TINY_QWEN3, "eos_token_id": eos}
    async with EmbeddedEngine(config, num_workers=1, seed=SEED, rpc_timeout_s=120) as engine:
        (stopped,) = await engine.generate_with_meta([PROMPTS[0]], max_new_tokens=6)
        (ignored,) = await engine.generate_with_meta(
            [PROMPTS[0]], max_new_tokens=6, ignore_eos=True
        )
    assert (stopped.token_ids, stopped.finish_reason) == (greedy[:stop_at], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (greedy, "length")
