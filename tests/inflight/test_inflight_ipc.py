"""Case C13 on the IPC transport into a real embedded engine: a request in flight while a sync runs.

Each test syncs OLD, starts a LONG greedy request, waits until it has computed
some tokens, then syncs NEW with an in-flight policy, and checks the request's
exact tokens and version labels against transformers' own computation.

``in_flight="wait"`` and ``"abort"`` (the request's tokens and version labels against
what the old weights alone compute) are the conformance kit's ``in_flight_*`` cells, on
every transport; here the exact continuation of ``"keep"`` and the failure paths.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import pytest_asyncio
from transformers import PreTrainedModel

from aiosync.engines.embedded.engine import EmbeddedEngine, EmbeddedGeneration
from aiosync.events import VersionEventKind, WeightVersionEvent
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.inflight import (
    CONFIG,
    ENGINE_SEED,
    LONG,
    OLD_SEED,
    PROMPT,
    FaultySource,
    InflightEnv,
    build_model,
    greedy_switch,
    mid_request,
    stage,
    sync_old,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class IPCEnv(InflightEnv):
    """The embedded engine the request runs on."""

    engine: EmbeddedEngine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[IPCEnv]:
    trainer = build_model(OLD_SEED)
    source = FaultySource(trainer)
    async with EmbeddedEngine(CONFIG, num_workers=1, seed=ENGINE_SEED) as engine:
        sync = IPCWeightSynchronizer(source, engine, rpc_timeout_s=60)
        async with sync:
            yield IPCEnv(sync, trainer, source, engine=engine)


async def _run_during_request(env: IPCEnv, call: Any) -> tuple[EmbeddedGeneration, Any]:
    """Start a LONG request, run ``call()`` once it is mid-way; both results."""
    results: list[EmbeddedGeneration] = []

    async def request() -> None:
        results.extend(
            await env.engine.generate_with_meta([PROMPT], max_new_tokens=LONG, ignore_eos=True)
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await mid_request(env.engine)
        outcome = await call()
    (result,) = results
    return result, outcome


async def _events_until(events: Any, kind: VersionEventKind) -> list[WeightVersionEvent]:
    seen = []
    with anyio.fail_after(10):
        async for event in events:
            seen.append(event)
            if event.kind == kind:
                return seen
    raise AssertionError(f"no {kind} event in {seen}")


async def test_decode_loop_is_transformers_greedy_token_for_token(
    env: IPCEnv, old_model: PreTrainedModel, old_tokens: list[int]
) -> None:
    version = await sync_old(env, old_model)
    (result,) = await env.engine.generate_with_meta([PROMPT], max_new_tokens=LONG, ignore_eos=True)
    assert result.token_ids == old_tokens
    assert (result.aborted, result.versions) == (False, [version] * LONG)
    assert await env.engine.generate([PROMPT], max_new_tokens=7) == [old_tokens[:7]]


async def test_keep_continues_the_request_on_new_weights_from_where_it_stopped(
    env: IPCEnv,
    old_model: PreTrainedModel,
    new_model: PreTrainedModel,
    old_tokens: list[int],
) -> None:
    old_version, new_version = await stage(env, old_model, new_model)
    env.sync.in_flight = "keep"  # the synchronizer's default, this time
    try:
        result, _ = await _run_during_request(env, env.sync.sync_weights)
    finally:
        env.sync.in_flight = "wait"
    k = result.version_change_at
    assert k is not None and 30 <= k < LONG
    assert result.aborted is False
    assert result.versions == [old_version] * k + [new_version] * (LONG - k)
    assert (result.first_version, result.last_version) == (old_version, new_version)
    assert result.token_ids[:k] == old_tokens[:k]
    # The rest: NEW's greedy continuation, attending to OLD's KV cache of the prefix.
    expected = greedy_switch(old_model, new_model, PROMPT, k, LONG)
    assert result.token_ids == expected
    assert expected[k:] != old_tokens[k:]


@pytest.mark.parametrize("how", ["failed", "cancelled"])
async def test_a_sync_failed_or_cancelled_mid_request_resumes_it_on_the_old_weights(
    env: IPCEnv,
    old_model: PreTrainedModel,
    new_model: PreTrainedModel,
    old_tokens: list[int],
    how: str,
) -> None:
    old_version, _ = await stage(env, old_model, new_model)
    if how == "failed":
        env.source.fail_before = RuntimeError("trainer offload failed")
    says = "trainer offload failed" if how == "failed" else "Cancelled"

    async def interrupted_sync() -> bool:
        if how == "failed":  # "keep": the request is frozen in place, then resumed
            with pytest.raises(RuntimeError, match="trainer offload failed"):
                await env.sync.sync_weights(in_flight="keep")
            return True
        # "wait" waits for the long request: cancelled while paused, before a byte moved.
        with anyio.move_on_after(0.2) as scope:
            await env.sync.sync_weights(in_flight="wait")
        return scope.cancelled_caught

    async with env.sync.subscribe() as events:
        result, interrupted = await _run_during_request(env, interrupted_sync)
        failed = (await _events_until(events, VersionEventKind.FAILED))[-1]
    assert interrupted is True
    # Nothing moved: resumed, the request ends on the weights it started with.
    assert result.token_ids == old_tokens
    assert (result.aborted, result.versions) == (False, [old_version] * LONG)
    assert failed.pause_s > 0.0 and says in (failed.error or "")
    (status,) = await env.engine.status()
    assert (status["paused"], env.sync.weight_version, env.sync.is_stale) == (
        None,
        old_version,
        True,
    )
    # New requests are admitted again, and the sync succeeds next time.
    env.source.fail_before = None
    assert await env.engine.generate([PROMPT], max_new_tokens=5) == [old_tokens[:5]]
    await env.sync.sync_weights()
    assert env.sync.is_stale is False


async def test_an_unknown_policy_is_refused_before_anything_moves(
    env: IPCEnv,
    old_model: PreTrainedModel,
    new_model: PreTrainedModel,
) -> None:
    old_version, _ = await stage(env, old_model, new_model)
    async with env.sync.subscribe() as events:
        refused = r"in_flight must be one of \('abort', 'wait', 'keep'\), got 'drop'"
        with pytest.raises(ValueError, match=refused):
            await env.sync.sync_weights(in_flight="drop")  # type: ignore[arg-type]
        env.sync.in_flight = "pause"  # type: ignore[assignment]
        try:
            with pytest.raises(ValueError, match="got 'pause'"):
                await env.sync.sync_weights()
        finally:
            env.sync.in_flight = "wait"
        with pytest.raises(ValueError, match="mode must be one of"):
            await env.engine.pause_generation("drop")  # type: ignore[arg-type]
        await env.sync.sync_weights()
        kinds = [(await anext(events)).kind for _ in range(2)]
    assert kinds == [VersionEventKind.SYNC_STARTED, VersionEventKind.COMMITTED]
    assert env.sync.weight_version == old_version + 1
