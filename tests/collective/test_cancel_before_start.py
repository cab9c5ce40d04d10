"""A sync step cancelled before its worker thread started must not leave the synchronizer
waiting for that thread: it never ran, so the next step runs at once (a fresh user's trial
found every later sync waiting ``collective_timeout_s`` and failing, for good)."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest

from aiosync import CollectiveWeightSynchronizer, TrainCluster
from aiosync.testing import StateDictSource

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_step_cancelled_while_queued_never_runs_and_the_next_one_does() -> None:
    import torch

    sync = CollectiveWeightSynchronizer(
        StateDictSource({"w": torch.zeros(2)}),
        None,
        train_cluster=TrainCluster(),
        inference_world_size=1,
        collective_timeout_s=2.0,
    )
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens, limiter.total_tokens = limiter.total_tokens, 1
    release = threading.Event()
    ran: list[str] = []
    try:
        async with anyio.create_task_group() as tg:
            # Hold the only worker-thread token, so the step below stays queued.
            tg.start_soon(anyio.to_thread.run_sync, release.wait)
            await anyio.wait_all_tasks_blocked()
            with anyio.move_on_after(0.2) as scope:
                await sync._in_thread(lambda: ran.append("cancelled"), 10.0)
            assert scope.cancelled_caught
            release.set()
        with anyio.fail_after(1.0):  # not collective_timeout_s, and no TransportError
            assert await sync._in_thread(lambda: ran.append("next") or 7, 10.0) == 7
    finally:
        release.set()
        limiter.total_tokens = tokens
    assert ran == ["next"]
