"""``on_failure="serve_previous"`` on real embedded engines: a sync that fails after its
buckets reached the workers, or is cancelled mid-transfer, leaves each engine holding
the previous version bit for bit, generating the trainer's greedy tokens of that
version labelled as it, over IPC and over the collective; with ``"refuse"`` the same
failure leaves the engine refusing (the failed sync did write it). In a rolling fleet
the failed wave's engine goes on serving instead of turning unfit. A transport that
cannot (HTTP) refuses the option at construction.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.from_thread
import pytest
import pytest_asyncio
import torch

from aiosync import (
    EngineFleet,
    SyncError,
    SyncOptions,
    TransportError,
    UnsupportedOptionError,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from tests._support.fleets import fleet_options, holds, started
from tests._support.sources import HookedSource, hooked_trainer

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
TOKENS = 4
#: Small buckets: the failure comes after several buckets were written.
BUCKET_BYTES = 16 * 1024
#: The tensor before which the trainer's source fails (or the sync is cancelled).
FAIL_AT = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[list[EmbeddedEngine]]:
    async with started(2, num_workers=2) as engines:
        yield engines


def _options(transport: str, on_failure: str, workers: int) -> dict[str, Any]:
    sync = SyncOptions(on_failure=on_failure)  # type: ignore[arg-type]
    return fleet_options(transport, workers, sync, bucket_bytes=BUCKET_BYTES)


class Broken(RuntimeError):
    pass


def _fail_at(source: HookedSource, how: str, scope: anyio.CancelScope) -> None:
    """Make the next sync fail (``"error"``: the source raises) or be cancelled
    (``"cancel"``) before tensor ``FAIL_AT``, after earlier buckets went out."""
    loop = threading.get_ident()

    def hook(i: int) -> None:
        if i != FAIL_AT:
            return
        source.on_tensor = lambda i: None
        if how == "error":
            raise Broken("the trainer's source failed mid-sync")
        if threading.get_ident() == loop:
            scope.cancel()
        else:
            anyio.from_thread.run_sync(scope.cancel)

    source.on_tensor = hook


async def _failing_sync(sync: Any, how: str, scope: anyio.CancelScope) -> None:
    if how == "error":
        # The collective reports the source's error as a TransportError naming it.
        with pytest.raises((Broken, TransportError), match="the trainer's source failed"):
            await sync.sync_weights()
    else:
        with scope:
            await sync.sync_weights()
        assert scope.cancelled_caught


_holds = holds


@in_module_loop
@pytest.mark.parametrize("how", ["error", "cancel"])
@pytest.mark.parametrize("transport", ["ipc", "collective"])
async def test_a_failed_sync_leaves_the_engine_serving_the_previous_version_bit_for_bit(
    engines: list[EmbeddedEngine], transport: str, how: str
) -> None:
    engine = engines[0]
    trainer, source = hooked_trainer(81)
    sync = create_weight_synchronizer(
        source, engine, backend="embedded", **_options(transport, "serve_previous", 2)
    )
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        # Each worker keeps one host copy of its weights (parameters and buffers).
        held = {id(t): t for t in trainer.model.state_dict(keep_vars=True).values()}
        assert sync.previous_nbytes == 2 * sum(t.numel() * t.element_size() for t in held.values())
        previous = trainer.hf_state_dict()
        expected = trainer.generate(PROMPTS, max_new_tokens=TOKENS)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.5)
        assert trainer.generate(PROMPTS, max_new_tokens=TOKENS) != expected

        scope = anyio.CancelScope()
        _fail_at(source, how, scope)
        await sync.mark_stale()
        await _failing_sync(sync, how, scope)
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        assert await _holds(engine, previous)
        outputs = await engine.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        assert [g.token_ids for g in outputs] == expected
        assert {(g.first_version, g.last_version) for g in outputs} == {(1, 1)}

        await sync.sync_weights()  # and the next sync commits as ever
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert await _holds(engine, trainer.hf_state_dict())


@in_module_loop
async def test_with_refuse_the_same_failure_leaves_the_engine_refusing(
    engines: list[EmbeddedEngine],
) -> None:
    engine = engines[0]
    trainer, source = hooked_trainer(82)
    sync = create_weight_synchronizer(
        source, engine, backend="embedded", **_options("ipc", "refuse", 2)
    )
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.previous_nbytes == 0
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.5)
        _fail_at(source, "error", anyio.CancelScope())
        await sync.mark_stale()
        await _failing_sync(sync, "error", anyio.CancelScope())
        # The failed sync wrote the workers: with "refuse" nothing is put back.
        with pytest.raises(SyncError, match="weights are not valid"):
            await engine.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        await sync.sync_weights()
        assert await _holds(engine, trainer.hf_state_dict())


@in_module_loop
async def test_a_rolling_fleets_failed_wave_serves_its_previous_version_instead_of_turning_unfit(
    engines: list[EmbeddedEngine],
) -> None:
    trainer, source = hooked_trainer(83)
    fleet = EngineFleet(engines, refit="rolling", max_unavailable=1)
    sync = create_weight_synchronizer(
        source, fleet, backend="embedded", **_options("ipc", "serve_previous", 4)
    )
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        expected = {1: trainer.generate(PROMPTS, max_new_tokens=TOKENS)}
        previous = trainer.hf_state_dict()
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.5)
        expected[2] = trainer.generate(PROMPTS, max_new_tokens=TOKENS)

        waves = 0

        def fail_in_second_wave(i: int) -> None:
            nonlocal waves
            waves += i == 0
            if waves == 2 and i == FAIL_AT:
                raise Broken("the trainer's source failed in the second wave")

        source.on_tensor = fail_in_second_wave
        await sync.mark_stale()
        with pytest.raises(Broken):
            await sync.sync_weights()
        source.on_tensor = lambda i: None
        assert (sync.weight_version, sync.is_stale) == (1, True)
        label = "engine {} of 2 (EmbeddedEngine)".format
        assert fleet.unfit == {}
        assert fleet.versions == {label(0): 2, label(1): 1}
        assert fleet.serving == engines
        assert await _holds(engines[0], trainer.hf_state_dict())
        assert await _holds(engines[1], previous)
        outputs = await fleet.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        for i, g in enumerate(outputs):  # prompt i on engine i % 2
            assert (g.first_version, g.token_ids) == (2 - i % 2, expected[2 - i % 2][i])


def test_a_transport_that_loads_in_place_refuses_serve_previous_at_construction() -> None:
    from aiosync.engines.sglang.backend import SGLangHTTPBackend

    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=84)
    server = SGLangHTTPBackend("http://127.0.0.1:9")  # constructing connects to nothing
    with pytest.raises(
        UnsupportedOptionError,
        match=r"^HTTPWeightSynchronizer does not honour on_failure='serve_previous'$",
    ):
        create_weight_synchronizer(
            HookedSource(trainer.model),
            server,
            colocated=True,
            sync=SyncOptions(on_failure="serve_previous"),
        )
    with pytest.raises(ValueError, match="on_failure must be one of"):
        SyncOptions(on_failure="retry")  # type: ignore[arg-type]
