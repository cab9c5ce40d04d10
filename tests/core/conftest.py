"""A real, in-process synchronizer for exercising the base class's contract.

``CopySynchronizer._transfer`` really moves data: it copies the policy's
arrays into the engine's dict, one entry at a time, so a failure or a
cancellation part-way leaves the engine half-updated, as a real transport would.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# pytest's importlib mode keeps this directory off sys.path; the harness lives beside.
sys.path.insert(0, str(Path(__file__).parent))

from core_harness import ArraySource, CopySynchronizer, RecordingEngine

__all__ = ["ArraySource", "CopySynchronizer", "RecordingEngine"]


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
