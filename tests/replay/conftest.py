"""A real, in-process synchronizer whose events drive the replay-buffer tests.

``StateDictSynchronizer.send`` really copies the trainer's state dict into
the engine's, entry by entry, and can be told to fail half-way: its events are
those of the base class, published by real syncs, not hand-made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from aiosync import KVScales, TransportCapabilities, WeightSynchronizer
from aiosync.testing import StateDictSource


class SteppingSource(StateDictSource):
    """A trainer of two float32 tensors, zeros at first; ``step()`` is an optimizer step
    (every entry + 1.0, in place, so the next sync sends it)."""

    def __init__(self) -> None:
        super().__init__({"w": torch.zeros(8), "b": torch.zeros(2)})

    def step(self) -> None:
        for tensor in self.state_dict.values():
            tensor.add_(1.0)


class StateDictEngine:
    """The engine: a state dict the synchronizer copies into."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    async def prepare_for_generation(self, tags: Any = None) -> None:
        return None

    async def finish_generation(self) -> None:
        return None


class StateDictSynchronizer(WeightSynchronizer):
    """Copies the trainer's state dict into the engine's; ``fail_next`` breaks one sync."""

    def __init__(self, policy: SteppingSource, generation: StateDictEngine, **kw: Any) -> None:
        super().__init__(policy, generation, **kw)
        self.fail_next = False

    capabilities = TransportCapabilities()

    async def open(self, sync: WeightSynchronizer) -> None:
        return None

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        return None

    async def close(self, sync: WeightSynchronizer) -> None:
        return None

    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
        nbytes = 0
        for i, (name, tensor) in enumerate(self.policy.iter_weights()):
            if self.fail_next and i == 1:
                self.fail_next = False
                raise RuntimeError("link dropped half-way")
            self.generation.state[name] = tensor.clone()
            nbytes += tensor.numel() * tensor.element_size()
            await anyio.sleep(0)
        return nbytes


@pytest.fixture
async def sync() -> AsyncIterator[StateDictSynchronizer]:
    async with StateDictSynchronizer(SteppingSource(), StateDictEngine()) as s:
        yield s
