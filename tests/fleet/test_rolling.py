"""Rolling refits: ``EngineFleet(refit="rolling", max_unavailable=1)`` over four real
embedded engines. One ``sync_weights()`` refits them one at a time; while an engine is
paused in its wave, ``fleet.generate`` runs to its end on the other three (it never
waits for the refit), and every output's version labels name the weights that computed
it: its tokens are the trainer's greedy tokens of that version. A wave that fails or is
cancelled leaves its engine unfit (serving nothing) while the waves before it serve the
new version and those after it the previous one; ``max_version_lag=0`` keeps the
previous one out too; the next sync heals the fleet. Quarantine, ``add_engine`` and
delta refits (every wave patched from the one baseline) compose with the waves; a
transport that cannot address part of the fleet is refused at construction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync import (
    EngineFleet,
    InFlightPolicy,
    SyncOptions,
    UnsupportedOptionError,
    VersionEventKind,
    WeightSynchronizer,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.options import TransportCapabilities
from tests._support.fleets import drain, fleet_options, holds, started
from tests._support.sources import HookedSource, hooked_trainer

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10], [11, 12], [13]]
TOKENS = 4


class SteppedEngine(EmbeddedEngine):
    """A real embedded engine that runs ``on_paused(self)`` once a sync paused it: the
    test acts while this engine's wave is in progress."""

    on_paused: Callable[[SteppedEngine], Awaitable[None]] | None = None

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        await super().pause_generation(mode, clear_cache)
        if self.on_paused is not None:
            await self.on_paused(self)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[list[SteppedEngine]]:
    async with started(4, SteppedEngine, num_workers=1) as engines:
        yield engines


@pytest.fixture(autouse=True)
def _no_hooks(engines: list[SteppedEngine]) -> None:
    for engine in engines:
        engine.on_paused = None


def _options(transport: str, sync: SyncOptions | None = None) -> dict[str, Any]:
    return fleet_options(transport, 4, sync)


def _step(trainer: HFModelRunner, factor: float) -> None:
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(factor)


async def _holds(engines: Sequence[EmbeddedEngine], want: dict[str, torch.Tensor]) -> list[bool]:
    return [await holds(engine, want) for engine in engines]


def _check_labels(outputs: list[Any], expected: dict[int, list[list[int]]]) -> list[int]:
    """Each output's tokens are the trainer's greedy tokens of the version that labels
    them (one version per output); returns the versions, in prompt order."""
    versions = []
    for i, g in enumerate(outputs):
        assert g.first_version == g.last_version, (i, g)
        assert g.token_ids == expected[g.first_version][i], (i, g.first_version)
        versions.append(g.first_version)
    return versions


async def _drain(events: Any) -> list[tuple[VersionEventKind, int, str | None]]:
    return [(e.kind, e.version, e.engine) for e in await drain(events)]


@in_module_loop
@pytest.mark.parametrize("transport", ["ipc", "collective"])
async def test_a_rolling_refit_serves_on_the_others_through_every_wave_labelled_truthfully(
    engines: list[SteppedEngine], transport: str
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=71)
    fleet = EngineFleet(engines, refit="rolling", max_unavailable=1)
    assert [[engines.index(e) for e in wave] for wave in fleet.waves()] == [[0], [1], [2], [3]]
    sync = create_weight_synchronizer(
        HookedSource(trainer.model), fleet, backend="embedded", **_options(transport)
    )
    async with sync, sync.subscribe() as events:
        await sync.mark_stale()
        await sync.sync_weights()
        await fleet.prepare_for_generation()
        expected = {1: trainer.generate(PROMPTS, max_new_tokens=TOKENS)}
        _step(trainer, 1.5)
        expected[2] = trainer.generate(PROMPTS, max_new_tokens=TOKENS)
        assert expected[1] != expected[2]  # else the labels could not be told apart

        during: dict[int, tuple[list[Any], list[Any]]] = {}

        async def generate_meanwhile(engine: SteppedEngine) -> None:
            # This engine is paused in its wave: the others serve, without waiting.
            serving = fleet.serving
            # timeout_s: a generate that waited for the paused engine would fail here.
            outputs = await fleet.generate_with_meta(PROMPTS, max_new_tokens=TOKENS, timeout_s=30.0)
            during[engines.index(engine)] = (serving, outputs)

        for engine in engines:
            engine.on_paused = generate_meanwhile
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)

        assert sorted(during) == [0, 1, 2, 3]
        for wave, (serving, outputs) in during.items():
            assert serving == [e for e in engines if e is not engines[wave]]
            # Prompt i goes to serving engine i % 3: the engines before this wave serve 2.
            owners = [engines.index(serving[i % 3]) for i in range(len(PROMPTS))]
            assert _check_labels(outputs, expected) == [2 if o < wave else 1 for o in owners]
        assert fleet.versions == {f"engine {i} of 4 (SteppedEngine)": 2 for i in range(4)}
        seen = await _drain(events)
        assert seen[-2:] == [
            (VersionEventKind.SYNC_STARTED, 2, None),
            (VersionEventKind.COMMITTED, 2, None),
        ]
        assert await _holds(engines, trainer.hf_state_dict()) == [True] * 4
        for engine in engines:
            engine.on_paused = None
        assert _check_labels(
            await fleet.generate_with_meta(PROMPTS, max_new_tokens=TOKENS), expected
        ) == [2] * len(PROMPTS)


@in_module_loop
@pytest.mark.parametrize("how", ["error", "cancel"])
async def test_a_failed_wave_leaves_its_engine_unfit_and_the_fleet_serving_both_versions(
    engines: list[SteppedEngine], how: str
) -> None:
    trainer, source = hooked_trainer(72)
    fleet = EngineFleet(engines, refit="rolling", max_unavailable=1)
    sync = create_weight_synchronizer(source, fleet, backend="embedded", **_options("ipc"))
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        await fleet.prepare_for_generation()
        expected = {1: trainer.generate(PROMPTS, max_new_tokens=TOKENS)}
        old = trainer.hf_state_dict()
        _step(trainer, 1.5)
        expected[2] = trainer.generate(PROMPTS, max_new_tokens=TOKENS)

        class Broken(RuntimeError):
            pass

        waves_started = 0

        def fail_in_third_wave(i: int) -> None:
            nonlocal waves_started
            waves_started += i == 0
            if waves_started == 3 and i == 5:
                raise Broken("the trainer's source failed in the third wave")

        scope = anyio.CancelScope()

        async def cancel_in_third_wave(engine: SteppedEngine) -> None:
            if engine is engines[2]:
                scope.cancel()

        if how == "error":
            source.on_tensor = fail_in_third_wave
        else:
            engines[2].on_paused = cancel_in_third_wave
        await sync.mark_stale()
        if how == "error":
            with pytest.raises(Broken):
                await sync.sync_weights()
        else:
            with scope:
                await sync.sync_weights()
            assert scope.cancelled_caught
        source.on_tensor = lambda i: None
        engines[2].on_paused = None

        assert (sync.weight_version, sync.is_stale) == (1, True)
        label = "engine {} of 4 (SteppedEngine)".format
        assert list(fleet.unfit) == [label(2)]
        assert fleet.versions == {label(0): 2, label(1): 2, label(2): None, label(3): 1}
        assert fleet.serving == [engines[0], engines[1], engines[3]]
        assert await _holds([engines[0], engines[1]], trainer.hf_state_dict()) == [True, True]
        assert await _holds([engines[3]], old) == [True]
        # The fleet keeps serving both committed versions, each labelled as itself.
        outputs = await fleet.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        assert _check_labels(outputs, expected) == [2, 2, 1, 2, 2, 1]
        # A lag bound of 0 keeps the engine left on version 1 out of service too.
        fleet.max_version_lag = 0
        assert fleet.serving == [engines[0], engines[1]]
        outputs = await fleet.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        assert _check_labels(outputs, expected) == [2] * len(PROMPTS)

        # The next sync refits the unfit engine in the first wave and heals the fleet.
        assert [[engines.index(e) for e in wave] for wave in fleet.waves()] == [
            [2, 0],
            [1],
            [3],
        ]
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert fleet.unfit == {} and fleet.serving == engines
        assert await _holds(engines, trainer.hf_state_dict()) == [True] * 4


@in_module_loop
async def test_a_rolling_wave_quarantines_its_dead_engine_and_a_new_one_joins_first(
    engines: list[SteppedEngine],
) -> None:
    trainer, source = hooked_trainer(73)
    fleet = EngineFleet(
        engines[:3], refit="rolling", max_unavailable=1, on_engine_failure="quarantine"
    )
    sync = create_weight_synchronizer(source, fleet, backend="embedded", **_options("ipc"))
    victim = engines[1]
    try:
        async with sync, sync.subscribe() as events:
            await sync.mark_stale()
            await sync.sync_weights()

            async def die(engine: SteppedEngine) -> None:
                import os
                import signal

                os.kill(engine.pids[0], signal.SIGKILL)

            victim.on_paused = die
            _step(trainer, 1.5)
            await sync.mark_stale()
            await sync.sync_weights()  # wave 2's engine is set aside; waves 1 and 3 commit
            victim.on_paused = None
            assert (sync.weight_version, sync.is_stale) == (2, False)
            assert list(fleet.quarantined) == ["engine 1 of 3 (SteppedEngine)"]
            assert fleet.serving == [engines[0], engines[2]]
            assert await _holds([engines[0], engines[2]], trainer.hf_state_dict()) == [True] * 2
            seen = await _drain(events)
            assert (
                VersionEventKind.ENGINE_QUARANTINED,
                2,
                "engine 1 of 3 (SteppedEngine)",
            ) in seen
            assert seen[-1][:2] == (VersionEventKind.COMMITTED, 2)

            # A new engine joins: it rides in the first wave and serves once committed.
            fleet.add_engine(engines[3])
            assert [[engines.index(e) for e in w] for w in fleet.waves()] == [[3, 0], [2]]
            _step(trainer, 0.5)
            await sync.mark_stale()
            await sync.sync_weights()
            assert fleet.serving == [engines[0], engines[2], engines[3]]
            assert await _holds(fleet.serving, trainer.hf_state_dict()) == [True] * 3
            seen = await _drain(events)
            assert seen[-2:] == [
                (VersionEventKind.COMMITTED, 3, None),
                (VersionEventKind.ENGINE_JOINED, 3, "engine 3 of 4 (SteppedEngine)"),
            ]
    finally:
        victim.on_paused = None
        with anyio.fail_after(30):
            while victim.processes[0].exitcode is None:
                await anyio.sleep(0.05)
        await victim.respawn_dead_workers()


@in_module_loop
async def test_a_rolling_delta_refit_patches_every_wave_from_one_baseline_bit_exact(
    engines: list[SteppedEngine],
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=74)
    fleet = EngineFleet(engines[:2], refit="rolling", max_unavailable=1)
    options = _options("ipc", SyncOptions(delta=True))
    sync = create_weight_synchronizer(
        HookedSource(trainer.model), fleet, backend="embedded", **options
    )
    async with sync, sync.subscribe() as events:
        await sync.mark_stale()
        await sync.sync_weights()  # full: the baseline
        with torch.no_grad():
            trainer.model.get_parameter("model.norm.weight").add_(1.0)  # one tensor changes
        await sync.mark_stale()
        await sync.sync_weights()
        assert await _holds(engines[:2], trainer.hf_state_dict()) == [True, True]
        committed = [e for e in await drain(events) if e.kind is VersionEventKind.COMMITTED]
        full, delta = committed
        assert (full.delta, delta.delta) == (False, True)
        # Each of the two waves got the model, then the same patch: the one changed tensor.
        model = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
        norm = trainer.model.get_parameter("model.norm.weight")
        assert (full.nbytes, delta.nbytes) == (2 * model, 2 * norm.numel() * norm.element_size())


@in_module_loop
@pytest.mark.parametrize("transport", ["ipc", "collective"])
async def test_peer_waves_take_the_version_from_the_first_wave_and_the_trainer_sends_one_copy(
    engines: list[SteppedEngine], transport: str
) -> None:
    trainer, source = hooked_trainer(75)
    reads = 0

    def count(i: int) -> None:
        nonlocal reads
        reads += i == 0  # one pass over the source

    source.on_tensor = count
    fleet = EngineFleet(engines, refit="rolling", max_unavailable=1, wave_source="peer")
    sync = create_weight_synchronizer(source, fleet, backend="embedded", **_options(transport))
    async with sync, sync.subscribe() as events:
        for step in (1, 2):
            await sync.mark_stale()
            await sync.sync_weights()
            assert (sync.weight_version, reads) == (step, step)  # one read per sync
            assert await _holds(engines, trainer.hf_state_dict()) == [True] * 4
            expected = trainer.generate(PROMPTS, max_new_tokens=TOKENS)
            outputs = await fleet.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
            assert _check_labels(outputs, {step: expected}) == [step] * len(PROMPTS)
            _step(trainer, 1.5)
        committed = [e for e in await drain(events) if e.kind is VersionEventKind.COMMITTED]
        # The trainer's bytes: one copy of the model per sync, for four engines.
        model = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
        assert [e.nbytes for e in committed] == [model, model]

    # With delta refits the waves a peer copies would hold no baseline: refused at init.
    fleet = EngineFleet(engines, refit="rolling", wave_source="peer")
    sync = create_weight_synchronizer(
        HookedSource(trainer.model),
        fleet,
        backend="embedded",
        **_options("ipc", SyncOptions(delta=True)),
    )
    with pytest.raises(UnsupportedOptionError, match=r"delta=True with .*wave_source='peer'"):
        await sync.init_communicator()
    await sync.shutdown()


class _PartialTransport:
    """A transport that cannot re-form over part of a fleet (``elastic=False``)."""

    capabilities = TransportCapabilities()

    async def open(self, sync: WeightSynchronizer) -> None: ...
    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: Any) -> int:
        return 0

    async def rejoin(self, sync: WeightSynchronizer) -> None: ...
    async def close(self, sync: WeightSynchronizer) -> None: ...


def test_a_transport_that_cannot_address_part_of_the_fleet_refuses_rolling_at_construction() -> (
    None
):
    fleet = EngineFleet([object(), object()], refit="rolling")
    with pytest.raises(UnsupportedOptionError, match=r"_PartialTransport cannot address part"):
        WeightSynchronizer(object(), fleet, transport=_PartialTransport())  # type: ignore[arg-type]
    # Nor can it set failed engines aside: quarantine is refused alike, never ignored.
    quarantining = EngineFleet([object(), object()], on_engine_failure="quarantine")
    with pytest.raises(UnsupportedOptionError, match=r"on_engine_failure='quarantine'"):
        WeightSynchronizer(object(), quarantining, transport=_PartialTransport())  # type: ignore[arg-type]
    # refit="all" needs nothing of it.
    WeightSynchronizer(object(), EngineFleet([object()]), transport=_PartialTransport())  # type: ignore[arg-type]


def test_waves_follow_max_unavailable() -> None:
    members = [object() for _ in range(5)]

    def waves(**options: Any) -> list[list[int]]:
        fleet = EngineFleet(members, refit="rolling", **options)
        return [[members.index(e) for e in wave] for wave in fleet.waves()]

    assert waves(max_unavailable=2) == [[0, 1], [2, 3], [4]]
    assert waves(max_unavailable=0.5) == [[0, 1], [2, 3], [4]]  # 0.5 of 5: 2
    assert waves(max_unavailable=0.1) == [[0], [1], [2], [3], [4]]  # at least 1
    assert waves(max_unavailable=9) == [[0, 1, 2, 3, 4]]
    assert [len(w) for w in EngineFleet(members).waves()] == [5]  # refit="all"
    for bad in (0, 1.0, 1.5, -0.5, True):
        with pytest.raises(ValueError, match="max_unavailable"):
            EngineFleet(members, refit="rolling", max_unavailable=bad)
    with pytest.raises(ValueError, match="refit"):
        EngineFleet(members, refit="waves")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_version_lag"):
        EngineFleet(members, max_version_lag=-1)
