"""Draft / MTP weights on the embedded engine over the collective transport (non-colocated:
the trainer broadcasts into the engine's workers through a sync group on 127.0.0.1): the
draft refit with the target in one sync under one version, or frozen bit for bit.

The synchronizer is built directly, so the draft option is applied as ``docs/draft.md``
says for that case: :func:`~aiosync.sources.apply_draft_option` tells the engine and
returns the source to send.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync import EmbeddedEngine, TrainCluster, VersionEventKind
from aiosync.capabilities import DraftRefit
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitSource, apply_draft_option, with_draft
from aiosync.transports.collective import CollectiveWeightSynchronizer
from tests._support.configs import DRAFT
from tests._support.configs import SMALL_QWEN3 as TARGET
from tests._support.net import free_port

PREFIX = "mtp."


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _differing(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``expected`` whose bytes differ in ``state`` (or that it lacks)."""
    return [n for n, t in expected.items() if n not in state or _bits(state[n]) != _bits(t)]


def _engine() -> EmbeddedEngine:
    # Two workers: the broadcast reaches every rank of the sync group, not just one.
    return EmbeddedEngine(
        Qwen3Config(**TARGET).to_dict(),
        num_workers=2,
        draft=Qwen3Config(**DRAFT).to_dict(),
        draft_prefix=PREFIX,
    )


def _collective(source: RefitSource, engine: EmbeddedEngine) -> CollectiveWeightSynchronizer:
    """As ``tests/_support/builders.non_colocated``, over ``source`` (it takes a model)."""
    return CollectiveWeightSynchronizer(
        source,
        engine,
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=engine.world_size,
        bucket_bytes=16 * 1024,  # many buckets: target and draft tensors share some
        collective_timeout_s=30.0,
    )


def _versions(statuses: list[Any]) -> list[tuple[Any, Any, Any]]:
    """Each worker's ``(weight_version, draft_weight_version, draft_refit)``."""
    return [(s["weight_version"], s["draft_weight_version"], s["draft_refit"]) for s in statuses]


async def _sync_once(
    source: RefitSource, engine: EmbeddedEngine, mode: DraftRefit
) -> tuple[list[dict[str, torch.Tensor]], list[Any], list[int]]:
    """One sync of ``source`` with the draft ``mode``: every worker's state after it, its
    status, and the versions of the COMMITTED events."""
    sync = _collective(apply_draft_option(source, engine, mode), engine)
    async with sync, sync.subscribe() as events:
        await sync.mark_stale()
        await sync.sync_weights()
        committed = []
        async for event in events:
            if event.kind is VersionEventKind.COMMITTED:
                committed.append(event.version)
                break
        assert sync.weight_version == 1
    return await engine.hf_state_dicts(), await engine.status(), committed


@pytest.mark.slow
async def test_collective_draft_with_target_lands_both_bit_exact_under_one_version() -> None:
    torch.manual_seed(21)
    target, draft = Qwen3ForCausalLM(Qwen3Config(**TARGET)), Qwen3ForCausalLM(Qwen3Config(**DRAFT))
    source = with_draft(DTensorRefitSource(target), DTensorRefitSource(draft), prefix=PREFIX)
    expected_target = dict(DTensorRefitSource(target).iter_weights())
    expected_draft = {PREFIX + n: t for n, t in DTensorRefitSource(draft).iter_weights()}
    async with _engine() as engine:
        before = await engine.hf_state_dicts()
        # Each worker's initial draft is not the trainer's: the sync is what makes it so.
        assert all(_differing(state, expected_draft) for state in before)
        states, statuses, committed = await _sync_once(source, engine, "with_target")
    assert len(states) == 2
    for state in states:
        assert _differing(state, expected_target) == []
        assert _differing(state, expected_draft) == []
    assert committed == [1]
    assert _versions(statuses) == [(1, 1, "with_target")] * 2


@pytest.mark.slow
async def test_collective_draft_frozen_keeps_every_workers_draft_bit_for_bit() -> None:
    torch.manual_seed(22)
    target, draft = Qwen3ForCausalLM(Qwen3Config(**TARGET)), Qwen3ForCausalLM(Qwen3Config(**DRAFT))
    source = with_draft(DTensorRefitSource(target), DTensorRefitSource(draft), prefix=PREFIX)
    expected_target = dict(DTensorRefitSource(target).iter_weights())
    async with _engine() as engine:
        before = await engine.hf_state_dicts()
        drafts_before = [{n: t for n, t in s.items() if n.startswith(PREFIX)} for s in before]
        assert all(drafts_before)
        states, statuses, committed = await _sync_once(source, engine, "frozen")
    for state, draft_before in zip(states, drafts_before, strict=True):
        assert _differing(state, expected_target) == []
        assert _differing(state, draft_before) == []  # as it was, not the trainer's draft
    assert committed == [1]
    assert _versions(statuses) == [(1, None, "frozen")] * 2
