"""The shared lifecycle on the IPC transport, into real engine processes.

``async with`` initializes; a set-up error propagates from it and leaves no
socket directory, segment or listener behind; a bad ``kv_scales`` is refused
before ``SYNC_STARTED`` (no event, no dirty flag, nothing streamed) and the next
valid sync commits; ``shutdown()`` removes the engine's discard listener.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import RefitMismatchError, SyncError
from aiosync.events import EventSubscription, VersionEventKind
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.checks import refuses_kv_scales

pytestmark = pytest.mark.asyncio(loop_scope="session")

BUCKET_BYTES = 16384

#: ``(kv_scales, error type, message)``: each refused by ``sync_weights`` before any event.
#: The tiny model has two layers (0 and 1), both with attention.
BAD_KV_SCALES: list[tuple[Any, type[Exception], str]] = [
    ({7: 1.0}, ValueError, r"kv_scales layer index 7 is not an attention layer .*: 0, 1\)"),
    (
        {"model.layers.5.self_attn.k_scale": 1.0},
        RefitMismatchError,
        r"the refit manifest has no 'model\.layers\.5\.self_attn\.' tensors",
    ),
    ([0.5], TypeError, "kv_scales must be a mapping, got list"),
    ({0: "1.0"}, TypeError, r"kv_scales\[0\] must be a float, got str"),
    ({0: -1.0}, ValueError, r"kv_scales\[0\] must be finite and > 0, got -1\.0"),
    ({"lm_head.weight": 1.0}, ValueError, "neither a layer index nor"),
]


def _listens(engine: EmbeddedEngine, listener: Callable[[], None]) -> int:
    """How many times ``listener`` is in the engine's discard-listener registry."""
    return sum(1 for registered in engine._discard_listeners if registered == listener)


def _ours() -> set[str]:
    """This process's IPC socket directories and shared-memory segments."""
    pid = os.getpid()
    dirs = {
        name for name in os.listdir(tempfile.gettempdir()) if name.startswith(f"aiosync-ipc-{pid}-")
    }
    segments = {name for name in os.listdir("/dev/shm") if name.startswith(f"aiosync-{pid}-")}
    return dirs | segments


def _drain(events: EventSubscription) -> list[tuple[VersionEventKind, int]]:
    out = []
    while (event := events.receive_nowait()) is not None:
        out.append((event.kind, event.version))
    return out


def _perturb(model: torch.nn.Module) -> None:
    """An "optimizer step": every parameter changes."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)


async def test_a_bad_kv_scales_is_refused_before_sync_started_and_the_next_sync_commits(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=41)
    log: list[str] = []
    source = h.TrainerSource(trainer.model, log)
    # No init_communicator(): async with initializes.
    async with (
        IPCWeightSynchronizer(source, dense_engine, bucket_bytes=BUCKET_BYTES) as sync,
        sync.subscribe() as events,
    ):
        assert sync.plan is not None and sync.num_workers == 1
        await sync.mark_stale()
        await sync.sync_weights()
        assert _drain(events) == [
            (VersionEventKind.STALE, 1),
            (VersionEventKind.SYNC_STARTED, 1),
            (VersionEventKind.COMMITTED, 1),
        ]
        (v1,) = await dense_engine.hf_state_dicts()
        _perturb(trainer.model)  # a leaked transfer would now change the engine
        streamed = list(log)

        # Not stale: a bad argument must not make it stale (no dirty flag).
        await refuses_kv_scales(sync, BAD_KV_SCALES, (1, 1, False))
        assert _drain(events) == []

        # Stale: refused the same way, the version stays.
        await sync.mark_stale()
        await refuses_kv_scales(sync, BAD_KV_SCALES, (2, 1, True))
        assert _drain(events) == [(VersionEventKind.STALE, 2)]
        assert log == streamed  # neither offloaded nor streamed
        (after,) = await dense_engine.hf_state_dicts()
        assert list(after) == list(v1)
        assert all(torch.equal(after[n], v1[n]) for n in v1)

        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert _drain(events) == [
            (VersionEventKind.SYNC_STARTED, 2),
            (VersionEventKind.COMMITTED, 2),
        ]
    await h.assert_engine_equals(dense_engine, trainer)


async def test_a_set_up_error_propagates_from_async_with_and_leaves_nothing_behind(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=42)
    renamed = h.TrainerSource(
        trainer.model, [], rename={"model.norm.weight": "model.final_norm.weight"}
    )
    before = _ours()
    sync = IPCWeightSynchronizer(renamed, dense_engine, bucket_bytes=BUCKET_BYTES)
    assert _listens(dense_engine, sync._invalidate_engine_weights) == 1
    # The worker refuses the plan (its RPC comes after the socket and the buffers opened).
    refused = r"(?s)aiosync_ipc_init.*model\.final_norm\.weight"
    with pytest.raises(RefitMismatchError, match=refused):
        async with sync:
            pytest.fail("the renamed manifest was accepted")
    assert sync.socket_dir is None
    assert _ours() == before
    assert _listens(dense_engine, sync._invalidate_engine_weights) == 0
    with pytest.raises(SyncError, match="IPCWeightSynchronizer was shut down"):
        await sync.mark_stale()


async def test_shutdown_removes_the_engines_discard_listener(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=43)
    sync = h.ipc_sync(trainer, dense_engine, bucket_bytes=BUCKET_BYTES)
    other = h.ipc_sync(trainer, dense_engine, bucket_bytes=BUCKET_BYTES)
    listener = sync._invalidate_engine_weights
    assert _listens(dense_engine, listener) == 1
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert _listens(dense_engine, listener) == 1
    assert _listens(dense_engine, listener) == 0
    await sync.shutdown()  # idempotent
    assert _listens(dense_engine, listener) == 0
    # Another synchronizer's listener is its own: still registered until its shutdown.
    assert _listens(dense_engine, other._invalidate_engine_weights) == 1
    await other.shutdown()
    assert _listens(dense_engine, other._invalidate_engine_weights) == 0
