"""A real, in-process synchronizer for exercising the base class's contract.

``CopySynchronizer._transfer`` really moves data: it copies the policy's
arrays into the engine's dict, one entry at a time, so a failure or a
cancellation part-way leaves the engine half-updated, as a real transport would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

from aiosync import KVScales, RefitSource, WeightSynchronizer


class ArraySource(RefitSource):
    """A trainer whose weights are numpy arrays, advanced by ``step()``."""

    def __init__(self) -> None:
        self.weights = {"a": np.zeros(4, np.float32), "b": np.zeros((2, 2), np.float32)}

    def step(self) -> None:
        for w in self.weights.values():
            w += 1

    def prepare_refit_info(self) -> dict[str, Any]:
        return {k: (v.shape, v.dtype) for k, v in self.weights.items()}

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        yield from self.weights.items()


class RecordingEngine:
    """Engine side: holds copies of the weights and records lifecycle calls."""

    def __init__(self) -> None:
        self.weights: dict[str, np.ndarray] = {}
        self.calls: list[tuple[str, tuple[str, ...] | None]] = []

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        self.calls.append(("prepare_for_generation", None if tags is None else tuple(tags)))

    async def finish_generation(self) -> None:
        self.calls.append(("finish_generation", None))


class CopySynchronizer(WeightSynchronizer):
    """Copies weights entry by entry; hooks let a test fail, block or count transfers."""

    def __init__(self, policy: ArraySource, generation: RecordingEngine, **kw: Any) -> None:
        super().__init__(policy, generation, **kw)
        self.transfers: list[int] = []
        self.fail_after_entries: int | None = None
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()
        self.kv_scales_seen: list[KVScales | None] = []

    async def _transfer(self, version: int, kv_scales: KVScales | None) -> int:
        self.transfers.append(version)
        self.kv_scales_seen.append(kv_scales)
        self.started.set()
        nbytes = 0
        for i, (name, array) in enumerate(self.policy.iter_weights()):
            if self.fail_after_entries is not None and i == self.fail_after_entries:
                raise RuntimeError(f"link dropped after {i} entries")
            self.generation.weights[name] = array.copy()
            nbytes += array.nbytes
            if self.gate is not None:
                await self.gate.wait()
        return nbytes


@pytest.fixture
def source() -> ArraySource:
    return ArraySource()


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine()


@pytest.fixture
async def sync(source: ArraySource, engine: RecordingEngine) -> Any:
    s = CopySynchronizer(source, engine)
    await s.init_communicator()
    yield s
    await s.shutdown()


@pytest.fixture
def make_sync(source: ArraySource, engine: RecordingEngine) -> Any:
    """Build more synchronizers on the same source and engine (with options)."""
    made: list[CopySynchronizer] = []

    def make(**kw: Any) -> CopySynchronizer:
        made.append(CopySynchronizer(source, engine, **kw))
        return made[-1]

    return make


def engine_holds(engine: RecordingEngine, source: ArraySource) -> bool:
    """True when the engine's weights equal the trainer's, name for name, byte for byte."""
    return set(engine.weights) == set(source.weights) and all(
        np.array_equal(engine.weights[k], v) for k, v in source.weights.items()
    )


@pytest.fixture
def holds() -> Any:
    return engine_holds
