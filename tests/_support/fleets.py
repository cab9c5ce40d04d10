"""Real embedded engines for the fleet tests, and the synchronizer options that drive
them over IPC or the collective."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import torch

from aiosync import CollectiveOptions, IPCOptions, SyncOptions, Timeouts, TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from tests._support.net import free_port

__all__ = ["drain", "fleet_options", "holds", "started"]


@contextlib.asynccontextmanager
async def started(
    count: int, cls: type[EmbeddedEngine] = EmbeddedEngine, **options: Any
) -> AsyncIterator[list[Any]]:
    """``count`` started ``cls(TINY_QWEN3, seed=7, rpc_timeout_s=60, **options)`` engines,
    shut down at the end."""
    engines = [cls(TINY_QWEN3, seed=7, rpc_timeout_s=60, **options) for _ in range(count)]
    try:
        for engine in engines:
            await engine.start()
        yield engines
    finally:
        for engine in engines:
            await engine.shutdown()


def fleet_options(
    transport: str, workers: int, sync: SyncOptions | None = None, **transport_options: Any
) -> dict[str, Any]:
    """``create_weight_synchronizer``'s keywords for ``transport`` (``"ipc"``, on the
    CPU, or ``"collective"``, gloo on a free loopback port) into ``workers`` workers."""
    common: dict[str, Any] = {"timeouts": Timeouts(rpc_s=30.0, collective_s=10.0)}
    if sync is not None:
        common["sync"] = sync
    if transport == "ipc":
        return {
            "colocated": True,
            "transport": IPCOptions(device="cpu", **transport_options),
            **common,
        }
    return {
        "colocated": False,
        "train_cluster": TrainCluster(master_port=free_port()),
        "inference_world_size": workers,
        "transport": CollectiveOptions(dist_backend="gloo", **transport_options),
        **common,
    }


async def holds(engine: EmbeddedEngine, want: dict[str, torch.Tensor]) -> bool:
    """Whether every worker of ``engine`` holds ``want`` bit for bit."""
    states = await engine.hf_state_dicts()
    return all(torch.equal(s[n], t) for s in states for n, t in want.items())


async def drain(events: Any) -> list[Any]:
    """The events published so far on the subscription ``events`` (each buffered before
    the call that made it returned): read until none comes within 0.5 s."""
    out = []
    while True:
        with anyio.move_on_after(0.5):
            out.append(await events.__anext__())
            continue
        return out
