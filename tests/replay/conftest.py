"""A real, in-process synchronizer whose events drive the replay-buffer tests.

``StateDictSynchronizer._transfer`` really copies the trainer's state dict into
the engine's, entry by entry, and can be told to fail half-way: its events are
those of the base class, published by real syncs, not hand-made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from aiosync import KVScales, RefitSource, WeightSynchronizer


class StateDictSource(RefitSource):
    """A trainer whose weights are numpy arrays; ``step()`` is an optimizer step."""

    def __init__(self) -> None:
        self.state = {"w": np.zeros(8, np.float32), "b": np.zeros(2, np.float32)}

    def step(self) -> None:
        for v in self.state.values():
            v += 1.0

    def prepare_refit_info(self) -> dict[str, Any]:
        return {k: (v.shape, v.dtype) for k, v in self.state.items()}

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        yield from self.state.items()


class StateDictEngine:
    """The engine: a state dict the synchronizer copies into."""

    def __init__(self) -> None:
        self.state: dict[str, np.ndarray] = {}

    async def prepare_for_generation(self, tags: Any = None) -> None:
        return None

    async def finish_generation(self) -> None:
        return None


class StateDictSynchronizer(WeightSynchronizer):
    """Copies the trainer's state dict into the engine's; ``fail_next`` breaks one sync."""

    def __init__(self, policy: StateDictSource, generation: StateDictEngine, **kw: Any) -> None:
        super().__init__(policy, generation, **kw)
        self.fail_next = False

    async def _transfer(self, version: int, kv_scales: KVScales | None) -> int:
        nbytes = 0
        for i, (name, array) in enumerate(self.policy.iter_weights()):
            if self.fail_next and i == 1:
                self.fail_next = False
                raise RuntimeError("link dropped half-way")
            self.generation.state[name] = array.copy()
            nbytes += array.nbytes
            await anyio.sleep(0)
        return nbytes


@pytest.fixture
async def sync() -> AsyncIterator[StateDictSynchronizer]:
    s = StateDictSynchronizer(StateDictSource(), StateDictEngine())
    await s.init_communicator()
    yield s
    await s.shutdown()
