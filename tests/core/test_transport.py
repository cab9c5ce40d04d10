"""A transport passed in: ``WeightSynchronizer(policy, generation, transport=...)`` calls
its phases (open, send, rejoin, close) and owns everything else."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from core_harness import ArraySource, RecordingEngine

from aiosync import (
    KVScales,
    Transport,
    TransportCapabilities,
    TransportError,
    VersionEventKind,
    WeightSynchronizer,
)


class DictTransport:
    """Copies the trainer's arrays into the engine's dict; records each phase."""

    capabilities = TransportCapabilities(kv_scales=False)

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.phases: list[tuple[str, Any]] = []

    async def open(self, sync: WeightSynchronizer) -> None:
        self.phases.append(("open", sync.weight_version))

    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
        self.phases.append(("send", version))
        if self.fail is not None:
            raise self.fail
        nbytes = 0
        for name, array in sync.policy.iter_weights():
            sync.generation.weights[name] = array.copy()
            nbytes += array.nbytes
        return nbytes

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        self.phases.append(("rejoin", sync.generation.membership_epoch))

    async def close(self, sync: WeightSynchronizer) -> None:
        self.phases.append(("close", None))


class GrowingFleet(RecordingEngine):
    """One engine that says its fleet's membership changed (an ``add_engine``)."""

    def __init__(self) -> None:
        super().__init__()
        self.membership_epoch = 0

    async def set_aside_failed(self, error: BaseException) -> list[tuple[str, str]]:
        return []

    def take_joined(self) -> list[str]:
        return []


def test_a_synchronizer_without_a_transport_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a transport: pass transport="):
        WeightSynchronizer(ArraySource(), RecordingEngine())
    assert isinstance(DictTransport(), Transport)


async def test_the_synchronizer_calls_the_phases_and_owns_the_versions() -> None:
    source, engine, transport = ArraySource(), RecordingEngine(), DictTransport()
    sync = WeightSynchronizer(source, engine, transport=transport)
    assert sync.capabilities is DictTransport.capabilities and not sync.supports_kv_scales
    async with sync, sync.subscribe() as events:
        source.step()
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert all(np.array_equal(engine.weights[k], v) for k, v in source.weights.items())
        kinds = [e.kind for e in [events.receive_nowait() for _ in range(3)] if e is not None]
        assert kinds == [
            VersionEventKind.STALE,
            VersionEventKind.SYNC_STARTED,
            VersionEventKind.COMMITTED,
        ]
    assert transport.phases == [("open", 0), ("send", 1), ("close", None)]


async def test_a_failed_send_leaves_the_version_and_is_raised_typed() -> None:
    transport = DictTransport(fail=TransportError("engine worker 1 exited with code -9"))
    async with WeightSynchronizer(ArraySource(), RecordingEngine(), transport=transport) as sync:
        await sync.mark_stale()
        with pytest.raises(TransportError, match="exited with code -9"):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (0, True)


async def test_kv_scales_the_transport_cannot_move_are_refused_before_send() -> None:
    transport = DictTransport()
    async with WeightSynchronizer(ArraySource(), RecordingEngine(), transport=transport) as sync:
        await sync.mark_stale()
        with pytest.raises(NotImplementedError, match="KV-cache scales"):
            await sync.sync_weights(kv_scales={0: 0.5})
        assert transport.phases == [("open", 0)]


async def test_a_membership_change_rejoins_before_the_next_send() -> None:
    fleet, transport = GrowingFleet(), DictTransport()
    async with WeightSynchronizer(ArraySource(), fleet, transport=transport) as sync:
        fleet.membership_epoch = 1
        await sync.mark_stale()
        await sync.sync_weights()
        await sync.mark_stale()
        await sync.sync_weights()
    assert transport.phases == [
        ("open", 0),
        ("rejoin", 1),
        ("send", 1),
        ("send", 2),
        ("close", None),
    ]
