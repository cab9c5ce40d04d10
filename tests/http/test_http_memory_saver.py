"""The memory-saver lifecycle against a real ``--enable-memory-saver`` test server (C5, C6)."""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.from_thread
import pytest

from aiosync import SGLangHTTPBackend, SyncError, refit_if_stale
from aiosync.transports.http import HTTPWeightSynchronizer
from tests._support.steps import first_sync
from tests.http.conftest import BUCKET_BYTES, http_sync

pytestmark = pytest.mark.slow


@pytest.fixture
def server(saver_server: Any) -> Any:
    saver_server.reset()
    return saver_server


def _memory_calls(log: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    keep = ("/release_memory_occupation", "/resume_memory_occupation", "/flush_cache")
    calls = []
    for entry in log:
        if entry["path"] in keep:
            calls.append((entry["path"], entry.get("tags")))
        elif entry["path"] == "/update_weights_from_tensor" and (
            not calls or calls[-1][0] != "update"
        ):
            calls.append(("update", None))
    return calls


async def test_release_after_generation_then_weights_refit_kv_cache_in_order(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=21)
    async with http_sync(server.url, trainer, synced=False, enable_memory_saver=True) as (
        backend,
        sync,
    ):
        await sync.mark_stale()
        assert await refit_if_stale(sync, backend)
        out = await backend.generate(prompts, max_new_tokens=4)
        assert out == trainer.reference_generate(prompts, 4)
        server.reset()

        await backend.finish_generation()  # the trainer's turn
        assert backend.asleep_tags == {"weights", "kv_cache"}
        trainer.step(seed=22)
        await sync.mark_stale()
        assert await refit_if_stale(sync, backend)
        assert backend.asleep_tags == frozenset()
        assert await backend.generate(prompts, max_new_tokens=4) == trainer.reference_generate(
            prompts, 4
        )
    assert _memory_calls(server.log()) == [
        ("/release_memory_occupation", ["weights", "kv_cache"]),
        ("/resume_memory_occupation", ["weights"]),
        ("update", None),
        ("/flush_cache", None),
        ("/resume_memory_occupation", ["kv_cache"]),
    ]
    assert trainer.events[-3:] == ["offload_before", "stream", "offload_after"]
    state_equal(server.state_dict(), trainer.expected())


async def test_discarded_weights_make_the_engine_stale_until_a_sync(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=23)
    async with http_sync(server.url, trainer, enable_memory_saver=True) as (backend, sync):
        assert not sync.is_stale

        await backend.finish_generation()
        # No optimizer step happened, yet the server discarded its weights (C6).
        assert sync.policy_version == sync.weight_version == 1
        assert sync.is_stale
        # Woken without a sync: the server holds garbage, and we refuse to use it.
        await backend.prepare_for_generation()
        assert all(math.isnan(t.float().flatten()[0]) for t in server.state_dict().values())
        with pytest.raises(SyncError, match="not re-synced"):
            await backend.generate(prompts, max_new_tokens=2)
        assert sync.is_stale

        await refit_if_stale(sync, backend)
        assert not sync.is_stale and sync.weight_version == 1
        state_equal(server.state_dict(), trainer.expected())
        assert await backend.generate(prompts, max_new_tokens=3) == trainer.reference_generate(
            prompts, 3
        )


async def test_without_memory_saver_the_server_stays_resident(
    tp2_server: Any, make_trainer: Any
) -> None:
    tp2_server.reset()
    trainer = make_trainer(seed=24)
    async with http_sync(tp2_server.url, trainer) as (backend, sync):
        await backend.finish_generation()
        await backend.prepare_for_generation()
        assert not sync.is_stale
    paths = {e["path"] for e in tp2_server.log()}
    assert "/release_memory_occupation" not in paths
    assert "/resume_memory_occupation" not in paths


async def test_memory_saver_mismatch_with_the_server_is_refused_at_init(
    server: Any, make_trainer: Any
) -> None:
    async with SGLangHTTPBackend(server.url, enable_memory_saver=False) as backend:
        sync = HTTPWeightSynchronizer(make_trainer(seed=25), backend)
        with pytest.raises(SyncError, match="enable_memory_saver"):
            await sync.init_communicator()


@pytest.mark.parametrize("at", [0, 7, 15])
async def test_weights_released_mid_sync_fail_it_and_the_server_refuses_until_a_sync_lands(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]], at: int
) -> None:
    """C14 on HTTP: the server's weights released while a sync streams (at the first
    tensor, mid-way, or the last): the sync fails instead of committing, the version
    stays, generation refuses, and the next sync heals."""
    trainer = make_trainer(seed=60 + at)
    async with http_sync(server.url, trainer, enable_memory_saver=True) as (backend, sync):
        names = list(trainer.prepare_refit_info())
        trigger = names[min(at, len(names) - 1)]

        def release(name: str) -> None:
            if name == trigger:
                trainer.on_tensor = None
                # The transport reads the source in a worker thread.
                anyio.from_thread.run(backend.finish_generation)

        trainer.step(seed=80 + at)
        await sync.mark_stale()
        trainer.on_tensor = release
        with pytest.raises(SyncError):
            await sync.sync_weights()
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (2, 1, True)
        assert await backend.get_weight_version() == "1"
        await backend.prepare_for_generation()
        with pytest.raises(SyncError):
            await backend.generate(prompts, max_new_tokens=2)

        await refit_if_stale(sync, backend)
        assert (sync.weight_version, sync.is_stale) == (2, False)
        state_equal(server.state_dict(), trainer.expected())
        assert await backend.generate(prompts, max_new_tokens=3) == trainer.reference_generate(
            prompts, 3
        )


class _ReleasesDuringTheFlush(SGLangHTTPBackend):
    """A backend whose first ``flush_cache`` of a sync is preceded by a real release of
    the server's memory (the loop's ``finish_generation`` racing the sync's flush)."""

    armed = False

    async def flush_cache(self, timeout_s: float | None = None) -> int:
        if self.armed:
            self.armed = False
            await self.finish_generation()
        return await super().flush_cache(timeout_s)


async def test_weights_released_during_the_flush_keep_the_backend_refusing_until_a_sync(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    """The sync's last bucket landed, then the server released (discarded) its weights
    while the sync flushed: the sync fails and the backend itself refuses to generate on
    the woken NaN weights, not only ``sync.is_stale`` (as the embedded engine does)."""
    trainer = make_trainer(seed=71)
    async with _ReleasesDuringTheFlush(server.url, enable_memory_saver=True) as backend:
        sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
        await first_sync(sync)
        trainer.step(seed=72)
        await sync.mark_stale()
        backend.armed = True
        with pytest.raises(SyncError, match="discarded its weights while version 2"):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        await backend.prepare_for_generation()
        assert all(math.isnan(t.float().flatten()[0]) for t in server.state_dict().values())
        assert not backend.weights_valid
        with pytest.raises(SyncError, match="not re-synced"):
            await backend.generate(prompts, max_new_tokens=2)

        await refit_if_stale(sync, backend)
        assert (sync.weight_version, sync.is_stale, backend.weights_valid) == (2, False, True)
        state_equal(server.state_dict(), trainer.expected())
        assert await backend.generate(prompts, max_new_tokens=3) == trainer.reference_generate(
            prompts, 3
        )
