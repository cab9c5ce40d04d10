"""The shared lifecycle on the LoRA-adapter transport, into real embedded engines.

``async with`` initializes; a set-up error propagates from it and leaves no
listener behind; any ``kv_scales`` is refused before ``SYNC_STARTED`` (no event,
no dirty flag, the adapter untouched); each engine of a list or a fleet that
discards its weights makes the synchronizer stale; ``shutdown()`` removes the
listener from every engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from lora_harness import CONFIG, ENGINE_SEED, NEW_TOKENS, PROMPTS, LoRATrainer, lora_engine

from aiosync import (
    EngineFleet,
    LoRAAdapterSynchronizer,
    RefitMismatchError,
    SyncError,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.engines.embedded._worker import tensor_to_wire
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.events import EventSubscription
from tests._support.checks import refuses_kv_scales
from tests._support.steps import sleep_at_level_2

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: ``(kv_scales, error type, message)``: each refused before any event. A
#: well-formed one is refused because an adapter-only refit moves no KV scales.
BAD_KV_SCALES: list[tuple[Any, type[Exception], str]] = [
    ({0: 1.0}, NotImplementedError, r"KV-cache scales.*needs a full refit"),
    ({}, NotImplementedError, r"KV-cache scales.*needs a full refit"),
    ({"model.layers.0.self_attn.k_scale": 2.0}, NotImplementedError, "needs a full refit"),
    ([0.5], TypeError, "kv_scales must be a mapping, got list"),
    ({0: float("nan")}, ValueError, r"kv_scales\[0\] must be finite and > 0"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[list[EmbeddedEngine]]:
    async with (
        lora_engine(1) as first,
        lora_engine(1) as second,
    ):
        yield [first, second]


@pytest.fixture(scope="module")
def base_wire() -> dict[str, Any]:
    """The engines' base weights, as ``embedded_load_state_dict`` takes them."""
    state = HFModelRunner.from_config(CONFIG, seed=ENGINE_SEED).hf_state_dict()
    return {name: tensor_to_wire(t) for name, t in state.items()}


def _listens(engine: EmbeddedEngine, listener: Callable[[], None]) -> int:
    """How many times ``listener`` is in the engine's discard-listener registry."""
    return sum(1 for registered in engine._discard_listeners if registered == listener)


def _drain(events: EventSubscription) -> list[tuple[VersionEventKind, int]]:
    out = []
    while (event := events.receive_nowait()) is not None:
        out.append((event.kind, event.version))
    return out


async def _adapters(engine: EmbeddedEngine) -> list[tuple[Any, Any, Any]]:
    """Each worker's ``(active adapter, adapters loaded, lora_valid)``."""
    return [(s["lora_adapter"], s["lora_loaded"], s["lora_valid"]) for s in await engine.status()]


async def _discard(engine: EmbeddedEngine, base_wire: dict[str, Any]) -> None:
    """A level-2 sleep (the engine drops its weights and reports it), then the
    base weights restored, as a full refit would."""
    await sleep_at_level_2(engine)
    await engine.prepare_for_generation()
    await engine.collective_rpc("embedded_load_state_dict", (base_wire,))


async def test_any_kv_scales_is_refused_before_sync_started_and_the_adapter_stays(
    engines: list[EmbeddedEngine], trainer: LoRATrainer
) -> None:
    engine = engines[0]
    # No init_communicator(): async with initializes.
    async with (
        LoRAAdapterSynchronizer(trainer.source, engine) as sync,
        sync.subscribe() as events,
    ):
        assert sync.modules
        await sync.mark_stale()
        await sync.sync_weights()
        v1 = await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert v1 == trainer.merged_generate()
        assert _drain(events) == [
            (VersionEventKind.STALE, 1),
            (VersionEventKind.SYNC_STARTED, 1),
            (VersionEventKind.COMMITTED, 1),
        ]

        await refuses_kv_scales(sync, BAD_KV_SCALES, (1, 1, False))  # not stale: it must stay so
        trainer.step(seed=21)
        await sync.mark_stale()
        await refuses_kv_scales(sync, BAD_KV_SCALES, (2, 1, True))
        assert _drain(events) == [(VersionEventKind.STALE, 2)]
        # Nothing moved: version 1's adapter still serves.
        assert await _adapters(engine) == [("aiosync-v1", ["aiosync-v1"], True)]
        assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == v1

        await sync.sync_weights()
        assert _drain(events) == [
            (VersionEventKind.SYNC_STARTED, 2),
            (VersionEventKind.COMMITTED, 2),
        ]
        assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )


async def test_a_set_up_error_propagates_from_async_with_and_leaves_no_listener(
    engines: list[EmbeddedEngine],
) -> None:
    narrow = LoRATrainer(config={**CONFIG, "intermediate_size": 96})
    sync = LoRAAdapterSynchronizer(narrow.source, engines)
    listener = sync._invalidate_engine_weights
    assert [_listens(e, listener) for e in engines] == [1, 1]
    # Both engines refuse; whichever answers first is named (they are asked at once).
    with pytest.raises(
        RefitMismatchError, match=r"engine \d of 2 \(EmbeddedEngine\): .*mlp\.gate_proj\.weight"
    ):
        async with sync:
            pytest.fail("an adapter for another model was accepted")
    assert [_listens(e, listener) for e in engines] == [0, 0]
    with pytest.raises(SyncError, match="LoRAAdapterSynchronizer was shut down"):
        await sync.mark_stale()


async def test_each_engine_of_a_list_that_discards_its_weights_makes_the_sync_stale(
    engines: list[EmbeddedEngine], trainer: LoRATrainer, base_wire: dict[str, Any]
) -> None:
    async with LoRAAdapterSynchronizer(trainer.source, engines) as sync:
        listener = sync._invalidate_engine_weights
        assert [_listens(e, listener) for e in engines] == [1, 1]
        await sync.mark_stale()
        await sync.sync_weights()
        for engine in engines:
            assert (sync.weight_version, sync.is_stale) == (1, False)
            await _discard(engine, base_wire)
            assert (sync.weight_version, sync.is_stale) == (1, True)
            assert engine.lora_adapter is None
            await sync.sync_weights()  # version 1 again, into both engines
            assert (sync.weight_version, sync.is_stale) == (1, False)
        expected = trainer.merged_generate()
        for engine in engines:
            assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected
    assert [_listens(e, listener) for e in engines] == [0, 0]


async def test_a_fleet_forwards_each_members_discards_and_shutdown_removes_them(
    engines: list[EmbeddedEngine], trainer: LoRATrainer, base_wire: dict[str, Any]
) -> None:
    async with create_weight_synchronizer(
        trainer.source, engines, colocated=False, backend="vllm"
    ) as sync:
        assert isinstance(sync.generation, EngineFleet)
        listener = sync._invalidate_engine_weights
        # Registered once, on the fleet, which relays every member's notices to it.
        assert [_listens(e, listener) for e in engines] == [0, 0]
        await sync.mark_stale()
        await sync.sync_weights()
        await _discard(engines[1], base_wire)
        assert (sync.weight_version, sync.is_stale) == (1, True)
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert [e.lora_adapter for e in engines] == ["aiosync-v1"] * 2
    # Shut down, it hears no member's discards any more.
    await _discard(engines[0], base_wire)
    assert (sync.weight_version, sync.is_stale) == (1, False)
