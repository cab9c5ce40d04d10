"""Fixtures for the IPC transport: real embedded-engine processes, a real trainer model.

Engines are session-scoped (starting one costs tens of seconds on a loaded
CPU); every test syncs before it asserts, so the state a previous test left
does not matter. Async fixtures and tests share the session event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import torch

from aiosync.engines.embedded.configs import TINY_QWEN3_MOE, TINY_QWEN3_TIED
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.checks import assert_engine_equals
from tests._support.proxy import RpcForwarder

MOE = TINY_QWEN3_MOE
DENSE_TIED = TINY_QWEN3_TIED
#: Engines initialise with this seed; trainers use others so a sync must change every tensor.
ENGINE_SEED = 3
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]


class TrainerSource(RefitSource):
    """A trainer's real refit source plus a shared lifecycle log and fault hooks.

    ``on_tensor(i)`` is called before the ``i``-th tensor is yielded (to kill or
    stop an engine mid-sync); ``rename`` renames manifest entries (C4).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        log: list[str],
        *,
        on_tensor: Callable[[int], None] | None = None,
        rename: Mapping[str, str] | None = None,
    ) -> None:
        self.inner = DTensorRefitSource(model)
        self.log = log
        self.on_tensor = on_tensor
        self.rename = dict(rename or {})

    def prepare_refit_info(self) -> RefitManifest:
        return {self.rename.get(n, n): spec for n, spec in self.inner.prepare_refit_info().items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.log.append("stream")
        for i, (name, tensor) in enumerate(self.inner.iter_weights()):
            if self.on_tensor is not None:
                self.on_tensor(i)
            yield self.rename.get(name, name), tensor

    def offload_before_refit(self) -> None:
        self.log.append("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.log.append("offload_after_refit")


class RecordingEngine(RpcForwarder):
    """Forwards to an :class:`EmbeddedEngine` its generation lifecycle calls, logging them,
    and ``collective_rpc`` (nothing else)."""

    def __init__(self, engine: EmbeddedEngine, log: list[str]) -> None:
        self.engine = engine
        self.log = log

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        self.log.append(f"prepare_for_generation({','.join(tags) if tags else 'all'})")
        await self.engine.prepare_for_generation(tags)

    async def finish_generation(self) -> None:
        self.log.append("finish_generation")
        await self.engine.finish_generation()


def trainer_model(config: Mapping[str, Any], seed: int) -> HFModelRunner:
    """The trainer's model: same architecture as the engine's, different weights."""
    return HFModelRunner.from_config(config, seed=seed)


def ipc_sync(trainer: HFModelRunner, engine: Any, **options: Any) -> IPCWeightSynchronizer:
    """An :class:`IPCWeightSynchronizer` from ``trainer``'s model (a :class:`TrainerSource`
    with no hook) into ``engine``, with ``options``."""
    return IPCWeightSynchronizer(TrainerSource(trainer.model, []), engine, **options)


async def assert_engine_serves(engine: Any, trainer: HFModelRunner, tokens: int) -> None:
    """Every worker holds the trainer's weights, and the engine generates the trainer's
    greedy tokens for :data:`PROMPTS` (``tokens`` each)."""
    await assert_engine_equals(engine, trainer)
    want = trainer.generate(PROMPTS, max_new_tokens=tokens)
    assert await engine.generate(PROMPTS, max_new_tokens=tokens) == want


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """This directory's helpers (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(
        MOE=MOE,
        DENSE_TIED=DENSE_TIED,
        PROMPTS=PROMPTS,
        TrainerSource=TrainerSource,
        RecordingEngine=RecordingEngine,
        trainer_model=trainer_model,
        ipc_sync=ipc_sync,
        assert_engine_equals=assert_engine_equals,
        assert_engine_serves=assert_engine_serves,
    )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def moe_engine() -> AsyncIterator[EmbeddedEngine]:
    """Two engine processes holding the tiny Qwen3-MoE."""
    async with EmbeddedEngine(MOE, num_workers=2, seed=ENGINE_SEED, rpc_timeout_s=120) as engine:
        yield engine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def dense_engine() -> AsyncIterator[EmbeddedEngine]:
    """One engine process holding the tiny tied-embedding Qwen3 (also used to kill workers)."""
    async with EmbeddedEngine(
        DENSE_TIED, num_workers=1, seed=ENGINE_SEED, rpc_timeout_s=120
    ) as engine:
        yield engine
