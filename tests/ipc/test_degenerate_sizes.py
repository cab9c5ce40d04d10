"""Degenerate manifests over IPC (C17) and a broken tie (C19), into real engine processes.

C17: zero-size tensors, and buckets of zero bytes, refit like any other: the
sync commits, no 0-byte shared-memory segment is created (``mmap`` refuses one).
C19: a trainer whose config ties ``lm_head`` but whose head is a tensor of its
own is refused by a tied engine at ``init_communicator()``, before any byte moves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch
from torch import nn

from aiosync import RefitMismatchError, SyncError
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.events import VersionEventKind
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: Every tensor has zero elements: embedding and head (0, 0), norm (0,), no layers.
ALL_EMPTY = {
    **TINY_QWEN3,
    "vocab_size": 0,
    "hidden_size": 0,
    "num_hidden_layers": 0,
}
#: Tiny Qwen3 with an empty MLP: gate/up (0, 64) and down (64, 0) between real tensors.
EMPTY_MLP = {**TINY_QWEN3, "intermediate_size": 0}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def empty_engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(ALL_EMPTY, num_workers=1, seed=3, rpc_timeout_s=120) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def empty_mlp_engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(EMPTY_MLP, num_workers=1, seed=3, rpc_timeout_s=120) as engine:
        yield engine


async def test_a_manifest_of_only_zero_size_tensors_commits(
    empty_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(ALL_EMPTY, seed=21)
    async with (
        h.ipc_sync(trainer, empty_engine, bucket_bytes=4096, rpc_timeout_s=60) as sync,
        sync.subscribe() as events,
    ):
        await sync.init_communicator()
        assert sync.plan is not None
        assert [(b.nbytes, [s.name for s in b.slots]) for b in sync.plan.buckets] == [
            (0, ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"])
        ]
        for step in (1, 2):  # the second sync reuses the worker's mapping of the empty bucket
            await sync.mark_stale()
            await sync.sync_weights()
            assert (sync.weight_version, sync.is_stale) == (step, False)
        kinds = [(ev.kind, ev.nbytes) for ev in [await anext(events) for _ in range(6)]]
        assert kinds[2] == kinds[5] == (VersionEventKind.COMMITTED, 0)
    (state,) = await empty_engine.hf_state_dicts()
    assert {n: (tuple(t.shape), t.dtype) for n, t in state.items()} == {
        "model.embed_tokens.weight": ((0, 0), torch.float32),
        "model.norm.weight": ((0,), torch.float32),
        "lm_head.weight": ((0, 0), torch.float32),
    }


async def test_zero_size_tensors_and_zero_byte_buckets_among_real_ones_commit_bit_exact(
    empty_mlp_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(EMPTY_MLP, seed=22)
    # 200-byte buckets: the norms share the two ping-pong buffers, every
    # projection travels alone in a buffer of its own, and each layer's empty
    # MLP is a bucket of zero bytes between them.
    async with h.ipc_sync(trainer, empty_mlp_engine, bucket_bytes=200, rpc_timeout_s=60) as sync:
        await sync.init_communicator()
        assert sync.plan is not None
        empty = [[s.name for s in b.slots] for b in sync.plan.buckets if b.nbytes == 0]
        assert empty == [
            [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
            for i in (0, 1)
        ]
        assert {b.nbytes for b in sync.plan.buckets if b.nbytes <= 200} == {0, 128}
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
    await h.assert_engine_serves(empty_mlp_engine, trainer, tokens=4)


async def test_a_broken_tie_is_refused_by_a_tied_engine_before_any_byte_moves(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # C19: the config ties lm_head, but the trainer's head was replaced and drifted.
    trainer = h.trainer_model(h.DENSE_TIED, seed=23)
    model = trainer.model
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach() + 0.25)
    (before,) = await dense_engine.hf_state_dicts()
    log: list[str] = []
    sync = IPCWeightSynchronizer(h.TrainerSource(model, log), dense_engine)
    # async with initializes: the refusal comes from the async-with line, and
    # the synchronizer is shut down on the way out.
    with pytest.raises(RefitMismatchError) as info:
        async with sync:
            pytest.fail("the broken tie was accepted")
    assert (sync.weight_version, sync.is_stale) == (0, False)
    with pytest.raises(SyncError, match="was shut down"):
        await sync.mark_stale()
    message = str(info.value)
    assert "1 name(s) unknown to the engine, first: ['lm_head.weight']" in message
    assert "the tie is broken" in message
    assert "re-tie it (model.tie_weights()) or set tie_word_embeddings=False" in message
    assert log == []  # the source was never streamed
    (after,) = await dense_engine.hf_state_dicts()
    assert list(after) == list(before)
    assert all(torch.equal(after[n], before[n]) for n in before)
