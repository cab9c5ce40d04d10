"""The kit's in-flight cells (case C13): a request running through a sync ends as its
policy (``wait``, ``abort``, ``keep``) says, its tokens and version labels exact, never
a silent mix."""

from __future__ import annotations

from typing import Any

import anyio

from aiosync import VersionEventKind

from .cases import TransportCase
from .engines import KitEngine
from .sync_checks import _assert_serves, _sync
from .trainers import LONG, LONG_PROMPT, STARTED, KitTrainer


async def _sync_during_request(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer, policy: str
) -> tuple[Any, list[int], Any]:
    """Version 1 synced; a LONG greedy request, and once it has STARTED tokens version
    2 synced with ``in_flight=policy``; then the engine serves version 2. Returns the
    request's result, what version 1 alone computes for it, and the ``COMMITTED``
    event of version 2 (``SYNC_STARTED`` of it just before)."""
    async with case.build(trainer, engine) as sync, sync.subscribe() as events:
        await _sync(sync)
        # One token more than the request: its first LONG are what version 1 computes
        # for it, and an answer cache (the SGLang server's) cannot serve the request.
        (alone,) = await engine.generate([LONG_PROMPT], LONG + 1)
        assert (alone.first_version, alone.last_version, alone.aborted) == (1, 1, False)
        assert alone.token_ids[:4] == trainer.generate([LONG_PROMPT], 4)[0]
        trainer.step(seed=14)
        await sync.mark_stale()
        results: list[Any] = []

        async def request() -> None:
            results.extend(await engine.generate([LONG_PROMPT], LONG))

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            with anyio.fail_after(120):
                while await engine.decoded() < STARTED:
                    await anyio.sleep(0.005)
            await sync.sync_weights(in_flight=policy)
        assert (sync.weight_version, sync.is_stale) == (2, False)
        seen = []
        with anyio.fail_after(60):
            async for event in events:
                seen.append(event)
                if (event.kind, event.version) == (VersionEventKind.COMMITTED, 2):
                    break
        assert (seen[-2].kind, seen[-2].version) == (VersionEventKind.SYNC_STARTED, 2)
        await _assert_serves(engine, trainer, 2)
    (result,) = results
    return result, list(alone.token_ids[:LONG]), seen[-1]


async def check_in_flight_wait(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """``in_flight="wait"`` (case C13): the running request finishes on version 1, every
    token what version 1 alone computes, before a byte moves (the pause lasts within the
    sync, not zero); then version 2 commits and serves."""
    result, alone, committed = await _sync_during_request(case, engine, trainer, "wait")
    assert list(result.token_ids) == alone
    assert (result.aborted, result.first_version, result.last_version) == (False, 1, 1)
    assert (result.version_change_at, result.spans_versions) == (None, False)
    assert 0.0 < committed.pause_s <= committed.duration_s


async def check_in_flight_abort(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer
) -> None:
    """``in_flight="abort"`` (case C13): the running request ends aborted (finish reason
    ``"abort"``) with a prefix of version 1's output, every token labelled version 1;
    version 2 commits and serves."""
    result, alone, _ = await _sync_during_request(case, engine, trainer, "abort")
    k = len(result.token_ids)
    assert (result.aborted, result.finish_reason) == (True, "abort")
    assert STARTED <= k < LONG
    assert list(result.token_ids) == alone[:k]
    assert (result.first_version, result.last_version, result.spans_versions) == (1, 1, False)


async def check_in_flight_keep(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """``in_flight="keep"`` (case C13): the running request lives through the refit and
    says so: tokens ``[0, k)`` are version 1's output, labelled 1, the rest computed by
    version 2 (``first_version`` 1, ``last_version`` 2, ``version_change_at`` k); never
    a silent mix. (Where the rest comes from, the old prefix's KV cache or a recompute,
    is the engine's: its own tests compare it with transformers.)"""
    result, alone, _ = await _sync_during_request(case, engine, trainer, "keep")
    k = result.version_change_at
    assert k is not None and STARTED <= k < LONG, k
    assert (result.aborted, result.finish_reason, len(result.token_ids)) == (False, "length", LONG)
    assert (result.first_version, result.last_version, result.spans_versions) == (1, 2, True)
    assert list(result.token_ids[:k]) == alone[:k]
    assert list(result.token_ids[k:]) != alone[k:]
