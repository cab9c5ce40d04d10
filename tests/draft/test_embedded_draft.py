"""Draft / MTP weights on the embedded engine over IPC: refit with the target under one
version, or frozen bit for bit with no draft byte sent; mismatches refused before any byte."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync import (
    EmbeddedEngine,
    RefitMismatchError,
    SyncOptions,
    UnsupportedOptionError,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.events import EventSubscription, WeightVersionEvent
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource, draft_under, with_draft
from tests._support.configs import DRAFT
from tests._support.configs import SMALL_QWEN3 as TARGET


def _models(seed: int) -> tuple[Qwen3ForCausalLM, Qwen3ForCausalLM]:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**TARGET)), Qwen3ForCausalLM(Qwen3Config(**DRAFT))


def _engine(draft: bool = True) -> EmbeddedEngine:
    return EmbeddedEngine(
        Qwen3Config(**TARGET).to_dict(),
        draft=Qwen3Config(**DRAFT).to_dict() if draft else None,
        draft_prefix="mtp.",
    )


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _same_bits(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The names whose bytes differ (or are missing) in ``state``."""
    return [n for n, t in expected.items() if n not in state or _bits(state[n]) != _bits(t)]


class CheckpointSource(RefitSource):
    """A checkpoint as a dict (Qwen3-Next's keeps its ``mtp.*`` tensors beside the
    target's); records the names it yields."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.yielded: list[str] = []

    def prepare_refit_info(self) -> RefitManifest:
        return {n: (tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            self.yielded.append(name)
            yield name, tensor


@pytest.mark.slow
async def test_draft_with_target_refits_both_bit_exact_under_one_version() -> None:
    target, draft = _models(seed=7)
    source = with_draft(DTensorRefitSource(target), DTensorRefitSource(draft), prefix="mtp.")
    expected_target = dict(DTensorRefitSource(target).iter_weights())
    expected_draft = {f"mtp.{n}": t for n, t in DTensorRefitSource(draft).iter_weights()}
    async with _engine() as engine:
        (before,) = await engine.hf_state_dicts()
        # The engine's initial draft differs from the trainer's: the sync is what makes them equal.
        assert _same_bits(before, expected_draft)
        sync = create_weight_synchronizer(
            source, engine, colocated=True, sync=SyncOptions(draft="with_target")
        )
        async with sync, sync.subscribe() as events:
            manifest = await engine.expected_manifest()
            assert set(manifest) == set(expected_target) | set(expected_draft)
            await sync.mark_stale()
            await sync.sync_weights()
            committed = [e async for e in _until_committed(events)]
        (state,) = await engine.hf_state_dicts()
        assert _same_bits(state, expected_target) == []
        assert _same_bits(state, expected_draft) == []
        (status,) = await engine.status()
        assert (status["weight_version"], status["draft_weight_version"]) == (1, 1)
        assert status["draft_refit"] == "with_target"
        everything = sum(t.numel() * t.element_size() for t in source_tensors(source))
        assert committed[-1].nbytes >= everything


def source_tensors(source: RefitSource) -> list[torch.Tensor]:
    return [t for _, t in source.iter_weights()]


async def _until_committed(events: EventSubscription) -> AsyncIterator[WeightVersionEvent]:
    async for event in events:
        yield event
        if event.kind is VersionEventKind.COMMITTED:
            return


@pytest.mark.slow
async def test_draft_frozen_sends_no_draft_byte_and_keeps_the_draft_bit_for_bit() -> None:
    target, draft = _models(seed=11)
    checkpoint = {
        **dict(DTensorRefitSource(target).iter_weights()),
        **{f"mtp.{n}": t for n, t in DTensorRefitSource(draft).iter_weights()},
    }
    inner = CheckpointSource(checkpoint)
    expected_target = {n: t for n, t in checkpoint.items() if not n.startswith("mtp.")}
    async with _engine() as engine:
        (before,) = await engine.hf_state_dicts()
        draft_before = {n: t for n, t in before.items() if n.startswith("mtp.")}
        assert draft_before and _same_bits(draft_before, {n: checkpoint[n] for n in draft_before})
        sync = create_weight_synchronizer(
            draft_under(inner, "mtp."), engine, colocated=True, sync=SyncOptions(draft="frozen")
        )
        async with sync, sync.subscribe() as events:
            # The engine's manifest leaves the draft out, and so does what the transport sends.
            assert not any(n.startswith("mtp.") for n in await engine.expected_manifest())
            assert set(sync.policy.prepare_refit_info()) == set(expected_target)
            await sync.mark_stale()
            await sync.sync_weights()
            committed = [e async for e in _until_committed(events)]
        (state,) = await engine.hf_state_dicts()
        assert _same_bits(state, expected_target) == []
        assert _same_bits(state, draft_before) == []  # the draft, bit for bit as it was
        (status,) = await engine.status()
        assert (status["weight_version"], status["draft_weight_version"]) == (1, None)
        assert status["draft_refit"] == "frozen"
        target_bytes = sum(t.numel() * t.element_size() for t in expected_target.values())
        draft_bytes = sum(t.numel() * t.element_size() for t in draft_before.values())
        assert target_bytes <= committed[-1].nbytes < target_bytes + draft_bytes


@pytest.mark.slow
async def test_draft_names_the_engine_lacks_or_misses_are_refused_before_any_byte() -> None:
    target, draft = _models(seed=3)
    drafted = with_draft(DTensorRefitSource(target), DTensorRefitSource(draft), prefix="mtp.")
    async with _engine(draft=False) as plain:
        # Asked to refit a draft the engine does not hold: refused at construction.
        with pytest.raises(UnsupportedOptionError, match="holds no draft model"):
            create_weight_synchronizer(
                drafted, plain, colocated=True, sync=SyncOptions(draft="with_target")
            )
        (before,) = await plain.hf_state_dicts()
        # Draft tensors the engine lacks: the manifest check at init refuses them.
        with pytest.raises(RefitMismatchError, match=r"mtp\."):
            async with create_weight_synchronizer(drafted, plain, colocated=True):
                pytest.fail("init must refuse the draft tensors")
        assert await plain.collective_rpc("embedded_lifecycle") == [[]]  # no load ran
        (after,) = await plain.hf_state_dicts()
        assert _same_bits(after, before) == []
    async with _engine() as holding:
        (before,) = await holding.hf_state_dicts()
        # The reverse: the engine's draft (refit with the target by default) is not in the source.
        with pytest.raises(RefitMismatchError, match=r"mtp\."):
            async with create_weight_synchronizer(
                DTensorRefitSource(target), holding, colocated=True
            ):
                pytest.fail("init must refuse a source without the draft")
        lifecycles = await holding.collective_rpc("embedded_lifecycle")
        assert lifecycles == [[]]  # no load ran: nothing moved
        (after,) = await holding.hf_state_dicts()
        assert _same_bits(after, before) == []
        # The same source with the draft frozen is what the engine then takes.
        sync = create_weight_synchronizer(
            DTensorRefitSource(target), holding, colocated=True, sync=SyncOptions(draft="frozen")
        )
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()
        (state,) = await holding.hf_state_dicts()
        assert _same_bits(state, dict(DTensorRefitSource(target).iter_weights())) == []
        assert _same_bits(state, {n: t for n, t in before.items() if n.startswith("mtp.")}) == []
