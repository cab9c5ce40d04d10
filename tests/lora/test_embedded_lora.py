"""Adapter-only refits into the embedded engine: real worker processes apply the adapter (PEFT).

Every sync is checked against the trainer itself: greedy generation equals that
of ``copy.deepcopy(peft_model).merge_and_unload()``, token for token (fp32,
``lora_B`` random and nonzero), and the engine's base weights stay untouched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from lora_harness import (
    ADAPTER_NBYTES,
    CONFIG,
    ENGINE_SEED,
    NEW_TOKENS,
    PROMPTS,
    LoRATrainer,
    base_generate,
    lora_engine,
)

import aiosync
from aiosync import LoRAAdapterSynchronizer, RefitMismatchError, SyncError, VersionEventKind
from aiosync.engines.embedded._worker import tensor_to_wire
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource, LoRAAdapterRefitSource
from tests._support.steps import first_sync, sleep_at_level_2

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[tuple[EmbeddedEngine, EmbeddedEngine]]:
    """Two workers (the adapter must reach both: prompts are split over them), and a
    second engine of one worker (a fleet's)."""
    async with lora_engine(2) as engine, lora_engine(1) as second:
        yield engine, second


@pytest.fixture(scope="module")
def engine(engines: tuple[EmbeddedEngine, EmbeddedEngine]) -> EmbeddedEngine:
    return engines[0]


@pytest.fixture(scope="module")
def base_outputs() -> list[list[int]]:
    return base_generate()


@pytest.fixture(scope="module")
def base_state() -> Iterator[dict[str, torch.Tensor]]:
    yield HFModelRunner.from_config(CONFIG, seed=ENGINE_SEED).hf_state_dict()


async def _adapters(engine: EmbeddedEngine) -> list[tuple[Any, Any, Any]]:
    """Each worker's ``(active adapter, adapters loaded, lora_valid)``."""
    return [(s["lora_adapter"], s["lora_loaded"], s["lora_valid"]) for s in await engine.status()]


async def test_sync_serves_the_adapter_exactly_as_the_merged_model(
    engine: EmbeddedEngine,
    trainer: LoRATrainer,
    base_outputs: list[list[int]],
    base_state: dict[str, torch.Tensor],
) -> None:
    async with aiosync.create_weight_synchronizer(
        trainer.source, engine, colocated=True, backend="embedded"
    ) as sync:
        assert type(sync) is LoRAAdapterSynchronizer
        await sync.init_communicator()
        async with sync.subscribe() as events:
            await sync.mark_stale()
            assert sync.is_stale
            await sync.sync_weights()
            got = [await events.__anext__() for _ in range(3)]
        assert [(e.kind, e.version, e.nbytes) for e in got] == [
            (VersionEventKind.STALE, 1, 0),
            (VersionEventKind.SYNC_STARTED, 1, 0),
            (VersionEventKind.COMMITTED, 1, ADAPTER_NBYTES),
        ]
        assert trainer.adapter_nbytes() == ADAPTER_NBYTES
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert (engine.weight_version, engine.lora_adapter) == (1, "aiosync-v1")
        assert await _adapters(engine) == [("aiosync-v1", ["aiosync-v1"], True)] * 2

        outputs = await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert outputs == trainer.merged_generate()
        assert outputs != base_outputs  # the adapter changes what the model says
        # Only the adapter travelled: the base weights are the engine's own, untouched.
        for state in await engine.hf_state_dicts():
            assert list(state) == list(base_state)
            assert all(torch.equal(state[name], t) for name, t in base_state.items())


async def test_a_second_sync_replaces_the_adapter(
    engine: EmbeddedEngine, trainer: LoRATrainer
) -> None:
    async with LoRAAdapterSynchronizer(trainer.source, engine) as sync:
        await first_sync(sync)
        first = await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert first == trainer.merged_generate()

        async with sync.policy_update() as version:
            trainer.step(seed=7)
        assert (version, sync.policy_version, sync.is_stale) == (2, 2, True)
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        second = await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert second == trainer.merged_generate()
        assert second != first
        # Replaced, not stacked: version 1's adapter is gone from every worker.
        assert await _adapters(engine) == [("aiosync-v2", ["aiosync-v2"], True)] * 2
        assert aiosync.lora_adapter_name(2) == engine.lora_adapter


#: What PEFT's refusal looks like, raised from the worker.
_NO_LAYER_FOR = (
    r"engine worker 0 \(embedded_load_lora_adapter\): adapter 'aiosync-v1': tensors the "
    r"model's adapter layers do not have: \['base_model\.model\.model\.layers\.0\.mlp\.down_proj"
)


class _InconsistentConfig(LoRAAdapterRefitSource):
    """Its config targets q_proj only, its tensors every linear layer: PEFT, in the
    engine's workers, refuses the tensors it has no layer for."""

    def lora_adapter_config(self) -> dict[str, Any]:
        return {**super().lora_adapter_config(), "target_modules": ["q_proj"]}


async def test_a_failed_load_keeps_the_version_and_the_engine_refuses_until_a_sync_lands(
    engine: EmbeddedEngine, trainer: LoRATrainer
) -> None:
    async with LoRAAdapterSynchronizer(trainer.source, engine) as good:
        await first_sync(good)
        assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )

        async with LoRAAdapterSynchronizer(_InconsistentConfig(trainer.model), engine) as bad:
            await bad.init_communicator()
            await bad.mark_stale()
            async with bad.subscribe() as events:
                with pytest.raises(RefitMismatchError, match=_NO_LAYER_FOR):
                    await bad.sync_weights()
                kinds = [(await events.__anext__()).kind for _ in range(2)]
            assert kinds == [VersionEventKind.SYNC_STARTED, VersionEventKind.FAILED]
            assert (bad.weight_version, bad.policy_version, bad.is_stale) == (0, 1, True)
            # Neither half an adapter nor, silently, the previous one.
            with pytest.raises(SyncError, match="did not complete"):
                await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            assert await _adapters(engine) == [(None, [], False)] * 2
            assert engine.lora_adapter is None

        # A sync that lands heals it.
        await good.mark_stale()
        await good.sync_weights()
        assert (good.weight_version, good.is_stale) == (2, False)
        assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )
        assert await _adapters(engine) == [("aiosync-v2", ["aiosync-v2"], True)] * 2


class _FullModelAsAdapter(LoRAAdapterRefitSource):
    """A full checkpoint posing as an adapter (a LoRA config over base-model tensors)."""

    def __init__(self, trainer: LoRATrainer, base: DTensorRefitSource) -> None:
        super().__init__(trainer.model)
        self.base = base

    def prepare_refit_info(self) -> Any:
        return self.base.prepare_refit_info()


async def test_init_refuses_what_is_not_an_adapter_or_does_not_fit_the_engine(
    engine: EmbeddedEngine, trainer: LoRATrainer
) -> None:
    full = DTensorRefitSource(HFModelRunner.from_config(CONFIG, seed=ENGINE_SEED).model)
    with pytest.raises(TypeError, match="LoRAAdapterSource"):
        LoRAAdapterSynchronizer(full, engine)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="has no load_lora_adapter"):
        LoRAAdapterSynchronizer(trainer.source, object())

    not_lora = r"'model\.embed_tokens\.weight' is not a LoRA tensor"
    with pytest.raises(RefitMismatchError, match=not_lora):
        async with LoRAAdapterSynchronizer(_FullModelAsAdapter(trainer, full), engine):
            pytest.fail("a full checkpoint was accepted as an adapter")

    # An adapter trained on a model whose MLP is 96 wide, for an engine whose MLP is 128.
    narrow = LoRATrainer(config={**CONFIG, "intermediate_size": 96})
    sync = LoRAAdapterSynchronizer(narrow.source, engine)
    try:
        with pytest.raises(
            RefitMismatchError,
            match=r"model\.layers\.0\.mlp\.gate_proj\.weight: the engine's model has shape "
            r"\(128, 64\), the adapter's .* imply \[96, 64\]",
        ):
            await sync.init_communicator()
        await sync.mark_stale()
        with pytest.raises(SyncError, match="init_communicator"):
            await sync.sync_weights()
    finally:
        await sync.shutdown()


async def test_level_2_sleep_discards_the_adapter_and_the_sync_says_the_base_is_gone(
    engine: EmbeddedEngine, trainer: LoRATrainer, base_state: dict[str, torch.Tensor]
) -> None:
    async with LoRAAdapterSynchronizer(trainer.source, engine) as sync:
        await first_sync(sync)
        await sleep_at_level_2(engine)
        # The discard listeners fired: the synchronizer knows a sync is needed.
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert engine.lora_adapter is None
        assert [(a, loaded) for a, loaded, _ in await _adapters(engine)] == [(None, [])] * 2
        await engine.prepare_for_generation()
        with pytest.raises(SyncError, match=r"an adapter-only refit\s+cannot restore them"):
            await sync.sync_weights()
        assert sync.is_stale

        # Restore the base model (what a full refit would do), then the adapter lands.
        wire = {name: tensor_to_wire(t) for name, t in base_state.items()}
        await engine.collective_rpc("embedded_load_state_dict", (wire,))
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )


async def test_a_fleet_loads_the_adapter_into_every_engine(
    engines: tuple[EmbeddedEngine, EmbeddedEngine], trainer: LoRATrainer
) -> None:
    engine, second_engine = engines
    # Non-colocated needs no cluster for an adapter: it travels through the engines' API.
    async with aiosync.create_weight_synchronizer(
        trainer.source, [engine, second_engine], colocated=False, backend="vllm"
    ) as sync:
        assert type(sync) is LoRAAdapterSynchronizer
        fleet = sync.generation
        assert isinstance(fleet, aiosync.EngineFleet)
        await first_sync(sync)
        assert sync.weight_version == 1
        assert await fleet.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )
        for member in (engine, second_engine):
            assert member.lora_adapter == "aiosync-v1"
            assert await member.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
                trainer.merged_generate()
            )
        assert await _adapters(second_engine) == [("aiosync-v1", ["aiosync-v1"], True)]
