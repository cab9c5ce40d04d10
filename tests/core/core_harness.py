"""The base class's test transport: a real, in-process synchronizer (see conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import numpy as np

from aiosync import KVScales, RefitSource, TransportCapabilities, WeightSynchronizer


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
    """Its own transport (the phases, as the shipped ones): copies weights entry by entry;
    hooks let a test fail, block or count transfers."""

    capabilities = TransportCapabilities()

    def __init__(self, policy: ArraySource, generation: RecordingEngine, **kw: Any) -> None:
        super().__init__(policy, generation, **kw)
        self.transfers: list[int] = []
        self.fail_after_entries: int | None = None
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()
        self.kv_scales_seen: list[KVScales | None] = []

    async def open(self, sync: WeightSynchronizer) -> None:
        return None

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        await self.open(sync)

    async def close(self, sync: WeightSynchronizer) -> None:
        return None

    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
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
