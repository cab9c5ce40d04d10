"""One Ray cluster for every test of this folder, on loopback, sized for a 2-core machine.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray take the loopback address as
the node's IP (set before ray is imported; Ray's processes inherit it): every
server Ray and aiosync start here binds 127.0.0.1. The cluster has 2 logical
GPUs (a custom count, on CPU) so that the actors' GPU requests are Ray's
bookkeeping, checked through Ray's own resource view.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import torch

from tests._support.checks import assert_engine_equals

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

#: Why this folder is skipped where Ray is missing.
NO_RAY = "Ray is not installed (pip install 'aiosync[ray]')"
#: Logical GPUs of the test cluster (on CPU: placement bookkeeping only).
CLUSTER_GPUS = 2
#: Engines initialise with this seed; trainers use others, so a sync changes every tensor.
ENGINE_SEED = 3
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("ray") is None:
        for item in items:
            if "tests/ray/" in str(item.path).replace(os.sep, "/"):
                item.add_marker(pytest.mark.skip(reason=NO_RAY))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """The session's Ray cluster (``ray`` itself): 2 CPUs, 2 logical GPUs, an 80 MB
    object store, no dashboard."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    ray.init(
        num_cpus=2,
        num_gpus=CLUSTER_GPUS,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        namespace="aiosync-tests",
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def trainer_model(seed: int) -> Any:
    """The trainer's tiny Qwen3 (float32), initialised with ``seed``."""
    from aiosync.engines.embedded.configs import TINY_QWEN3
    from aiosync.engines.embedded.model import HFModelRunner

    return HFModelRunner.from_config(TINY_QWEN3, seed=seed)


def advance(model: torch.nn.Module, factor: float = 1.25) -> None:
    """One "optimizer step": every parameter times ``factor``."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """This folder's helpers (test modules cannot import conftest under importlib mode)."""
    names = "CLUSTER_GPUS ENGINE_SEED PROMPTS trainer_model advance assert_engine_equals"
    values = CLUSTER_GPUS, ENGINE_SEED, PROMPTS, trainer_model, advance, assert_engine_equals
    return SimpleNamespace(**dict(zip(names.split(), values, strict=True)))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(ray_cluster: Any) -> AsyncIterator[Any]:
    """One colocated engine actor (the embedded engine, one worker) on this node,
    requesting the scheduler's share of a GPU for two colocated groups."""
    from aiosync.engines.embedded.configs import TINY_QWEN3
    from aiosync.ray import EngineSpec, launch_engine

    spec = EngineSpec.embedded(TINY_QWEN3, seed=ENGINE_SEED, rpc_timeout_s=120)
    ray_engine = await launch_engine(
        spec, colocated=True, max_colocated_worker_groups=2, num_cpus=0
    )
    try:
        yield ray_engine
    finally:
        await ray_engine.shutdown()
