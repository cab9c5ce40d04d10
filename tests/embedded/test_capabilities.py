"""The embedded engine's typed capabilities, its one generation contract and the
anyio admission gate (engines/_gate.py), without starting worker processes."""

from __future__ import annotations

import anyio
import pytest

from aiosync.capabilities import (
    ManifestReporting,
)
from aiosync.engines._gate import AdmissionGate
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import SyncError, SyncTimeoutError
from tests._support.checks import ENGINE_CAPABILITIES

pytest.importorskip("transformers")


def test_the_engine_satisfies_the_protocols_it_claims() -> None:
    engine = EmbeddedEngine(TINY_QWEN3)
    for protocol in (*ENGINE_CAPABILITIES, ManifestReporting):
        assert isinstance(engine, protocol), protocol.__name__


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": 2, "temperature": -1.0}, ValueError, "temperature must be >= 0"),
        ({"max_new_tokens": 2, "top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        (
            {"max_new_tokens": 2, "beams": 4},
            TypeError,
            r"unknown sampling keyword\(s\) \['beams'\]",
        ),
        ({}, TypeError, "needs params=SamplingParams"),
    ],
)
async def test_sampling_parameters_are_checked_before_any_worker_is_asked(
    keywords: dict[str, object], error: type[Exception], message: str
) -> None:
    engine = EmbeddedEngine(TINY_QWEN3)  # never started: a worker call would be SyncError
    with pytest.raises(error, match=message):
        await engine.generate([[1, 2]], **keywords)  # type: ignore[arg-type]
    with pytest.raises(SyncError, match="start"):
        await engine.generate([[1, 2]], max_new_tokens=2)


async def test_a_paused_gate_holds_new_calls_until_resumed() -> None:
    gate = AdmissionGate("the test engine")
    gate.pause()
    admitted: list[str] = []

    async def call() -> None:
        async with gate.shared(60.0):
            admitted.append("in")

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert admitted == [] and gate.running == 0
        gate.resume()
    assert admitted == ["in"]


async def test_a_call_held_past_its_limit_names_the_pause() -> None:
    gate = AdmissionGate("the test engine")
    gate.pause()
    with pytest.raises(
        SyncTimeoutError, match=r"waited 0\.01 s for the test engine, still paused for a sync"
    ):
        async with gate.shared(0.01):
            pass
    assert gate.running == 0


async def test_exclusive_waits_for_running_calls_and_holds_new_ones() -> None:
    gate = AdmissionGate("the test engine")
    order: list[str] = []
    release = anyio.Event()

    async def running() -> None:
        async with gate.shared(60.0):
            order.append("running")
            await release.wait()
        order.append("running ended")

    async def load() -> None:
        async with gate.exclusive():
            order.append("load")

    async def late() -> None:
        async with gate.shared(60.0):
            order.append("late")

    async with anyio.create_task_group() as tg:
        tg.start_soon(running)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(late)
        await anyio.wait_all_tasks_blocked()
        assert order == ["running"]
        release.set()
    assert order == ["running", "running ended", "load", "late"]
