"""Case C27: a second synchronizer on an engine that served another's versions (issue 42).

A trainer restarts (a new synchronizer, versions from 0) onto an embedded
engine that already served version 4 of the previous run. Once it commits, the
engine labels its tokens with the new owner's version (lower than 4), and a
request kept in flight across that refit reports the change, even where both
owners' labels are the same number.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
from transformers import PreTrainedModel

from aiosync.engines.embedded.engine import EmbeddedEngine, EmbeddedGeneration
from aiosync.generation import Generation
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.inflight import (
    CONFIG,
    ENGINE_SEED,
    LONG,
    NEW_SEED,
    OLD_SEED,
    PROMPT,
    FaultySource,
    build_model,
    greedy_switch,
    hf_greedy,
    mid_request,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(CONFIG, num_workers=1, seed=ENGINE_SEED) as engine:
        yield engine


@pytest.fixture(scope="module")
def old_model() -> PreTrainedModel:
    return build_model(OLD_SEED)


@pytest.fixture(scope="module")
def new_model() -> PreTrainedModel:
    return build_model(NEW_SEED)


async def _serve(engine: EmbeddedEngine, model: PreTrainedModel, version: int) -> None:
    """A first trainer's run: ``model``'s weights committed as ``version``, then gone."""
    async with IPCWeightSynchronizer(FaultySource(model), engine, rpc_timeout_s=60) as first:
        await first.mark_stale(version)
        await first.sync_weights()
        (before,) = await engine.generate_with_meta([PROMPT], max_new_tokens=3)
        assert isinstance(before, EmbeddedGeneration)
        assert before.versions == [version] * 3


async def _keep_across_restart(
    engine: EmbeddedEngine, new_model: PreTrainedModel, new_version: int
) -> EmbeddedGeneration:
    """A restarted trainer commits ``new_version`` with ``keep`` while a LONG request runs."""
    results: list[Generation] = []
    restarted = IPCWeightSynchronizer(
        FaultySource(new_model), engine, rpc_timeout_s=60, in_flight="keep"
    )
    async with restarted:
        assert (restarted.weight_version, restarted.is_stale) == (0, True)
        if new_version:
            await restarted.mark_stale(new_version)

        async def request() -> None:
            results.extend(
                await engine.generate_with_meta([PROMPT], max_new_tokens=LONG, ignore_eos=True)
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await mid_request(engine)
            await restarted.sync_weights()
        assert restarted.weight_version == new_version
    (result,) = results
    assert isinstance(result, EmbeddedGeneration)
    return result


async def test_a_restarted_trainers_lower_versions_label_the_engines_outputs(
    engine: EmbeddedEngine, old_model: PreTrainedModel, new_model: PreTrainedModel
) -> None:
    await _serve(engine, old_model, 4)
    async with IPCWeightSynchronizer(FaultySource(new_model), engine, rpc_timeout_s=60) as again:
        assert (again.weight_version, again.is_stale) == (0, True)
        await again.mark_stale()
        await again.mark_stale()
        await again.sync_weights()
        assert again.weight_version == 2
        (result,) = await engine.generate_with_meta([PROMPT], max_new_tokens=8)
        assert isinstance(result, EmbeddedGeneration)
        # The new owner's weights computed them: its version labels them, not the 4 of before.
        assert result.token_ids == hf_greedy(new_model, PROMPT, 8)
        assert (result.versions, result.first_version, result.last_version) == ([2] * 8, 2, 2)
        (status,) = await engine.status()
        assert (engine.weight_version, status["weight_version"]) == (2, 2)


async def test_a_request_kept_across_a_restarted_trainers_refit_reports_both_versions(
    engine: EmbeddedEngine, old_model: PreTrainedModel, new_model: PreTrainedModel
) -> None:
    await _serve(engine, old_model, 4)
    result = await _keep_across_restart(engine, new_model, 2)
    k = result.version_change_at
    assert k is not None and 30 <= k < LONG
    assert result.versions == [4] * k + [2] * (LONG - k)
    assert (result.first_version, result.last_version, result.spans_versions) == (4, 2, True)
    assert result.token_ids == greedy_switch(old_model, new_model, PROMPT, k, LONG)


async def test_a_kept_request_spans_two_owners_weights_that_carry_the_same_label(
    engine: EmbeddedEngine, old_model: PreTrainedModel, new_model: PreTrainedModel
) -> None:
    # The first run's version 1 and the restarted run's version 1 are different weights.
    await _serve(engine, old_model, 1)
    result = await _keep_across_restart(engine, new_model, 1)
    k = result.version_change_at
    assert k is not None and 30 <= k < LONG, "two weight sets computed it: the change is reported"
    assert result.spans_versions is True
    assert result.token_ids == greedy_switch(old_model, new_model, PROMPT, k, LONG)
