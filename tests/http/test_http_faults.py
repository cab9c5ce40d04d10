"""Faults: a real test server told to fail; typed errors in time, versions kept, recovery.

The server runs with ``--api-key``, so every test also proves the key is sent.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch

from aiosync import SGLangHTTPBackend, SyncError, SyncTimeoutError, TransportError
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http._segment import own_segments
from tests._support.steps import first_sync

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 3.0
FLUSH_TIMEOUT_S = 2.0
#: Whole-sync limit of the interrupted-sync test, seconds: ample for buckets 0 and 1.
INTERRUPT_SYNC_TIMEOUT_S = 8.0


@pytest.fixture
def server(auth_server: Any) -> Any:
    auth_server.reset()
    yield auth_server
    auth_server.reset()  # release anything still hung


async def _synced(server: Any, trainer: Any) -> tuple[HTTPWeightSynchronizer, SGLangHTTPBackend]:
    backend = SGLangHTTPBackend(
        server.url,
        api_key=server.api_key,
        request_timeout_s=REQUEST_TIMEOUT_S,
        flush_timeout_s=FLUSH_TIMEOUT_S,
    )
    sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
    await first_sync(sync)
    assert sync.weight_version == 1
    return sync, backend


async def _stale_after_v1(
    server: Any, make_trainer: Any, seed: int
) -> tuple[Any, HTTPWeightSynchronizer, SGLangHTTPBackend]:
    """A trainer (``seed``) synced once (:func:`_synced`), then stepped: version 1 on the
    server, the synchronizer stale."""
    trainer = make_trainer(seed=seed)
    sync, backend = await _synced(server, trainer)
    trainer.step(seed=seed + 1)
    await sync.mark_stale()
    return trainer, sync, backend


async def _serves_v2(backend: Any, trainer: Any, prompts: list[list[int]]) -> None:
    """The server generates the trainer's greedy tokens, every answer labelled "2"."""
    results = await backend.generate_with_meta(prompts, max_new_tokens=4)
    assert [r.output_ids for r in results] == trainer.reference_generate(prompts, 4)
    assert [r.weight_version for r in results] == ["2"] * len(prompts)


async def _heals_to_v2(
    server: Any, trainer: Any, sync: HTTPWeightSynchronizer, backend: Any, state_equal: Any
) -> None:
    """After a failed sync: the next lands version 2, the server says so and holds
    exactly the trainer's tensors."""
    await sync.sync_weights()
    assert (sync.weight_version, sync.is_stale) == (2, False)
    assert await backend.get_weight_version() == "2"
    state_equal(server.state_dict(), trainer.expected())


async def _fails_then_recovers(
    server: Any,
    trainer: Any,
    state_equal: Any,
    path: str,
    mode: str,
    error: type[Exception],
    match: str,
) -> None:
    before = set(own_segments())
    sync, backend = await _synced(server, trainer)
    assert len(set(own_segments()) - before) in (1, 2)  # two when packing overlapped a post
    trainer.step(seed=31)
    await sync.mark_stale()
    server.fault(path, mode, count=1)
    start = time.monotonic()
    with pytest.raises(error, match=match):
        await sync.sync_weights()
    elapsed = time.monotonic() - start
    assert elapsed < REQUEST_TIMEOUT_S + FLUSH_TIMEOUT_S + 30  # bounded, not stuck
    assert sync.weight_version == 1 and sync.is_stale
    assert await backend.get_weight_version() == "1"
    # The colocated hooks ran in the finally.
    assert trainer.events[-1] == "offload_after"
    # An unanswered post: the server may decode it later, so every segment is
    # unlinked and never written again.
    assert set(own_segments()) - before == set()
    server.reset()
    await sync.sync_weights()
    assert sync.weight_version == 2 and not sync.is_stale
    assert await backend.get_weight_version() == "2"
    state_equal(server.state_dict(), trainer.expected())
    await sync.shutdown()
    assert set(own_segments()) - before == set()
    await backend.aclose()


@pytest.mark.parametrize(
    ("mode", "seed", "error", "match"),
    [
        ("error", 30, TransportError, "HTTP 500: injected fault on /update_weights_from_tensor"),
        ("hang", 32, SyncTimeoutError, f"no answer within {REQUEST_TIMEOUT_S} s"),
        ("drop", 33, TransportError, "RemoteProtocolError"),
    ],
    ids=["server_500_names_the_servers_message", "hung_server_times_out", "dropped_connection"],
)
async def test_a_failed_weight_post_is_a_typed_error_and_the_next_sync_recovers(
    server: Any,
    make_trainer: Any,
    state_equal: Any,
    mode: str,
    seed: int,
    error: type[Exception],
    match: str,
) -> None:
    trainer = make_trainer(seed=seed)
    path = "/update_weights_from_tensor"
    await _fails_then_recovers(server, trainer, state_equal, path, mode, error, match)


async def test_flush_that_never_succeeds_fails_the_sync_after_the_flush_budget(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    before = set(own_segments())
    sync, backend = await _synced(server, make_trainer(seed=34))
    kept = set(own_segments()) - before
    server.reset()
    await sync.mark_stale()
    server.fault("/flush_cache", "busy", count=None)
    with pytest.raises(TransportError, match=r"/flush_cache did not succeed within 2.0 s"):
        await sync.sync_weights()
    assert sync.weight_version == 1 and sync.is_stale
    flushes = [e for e in server.log() if e["path"] == "/flush_cache"]
    assert len(flushes) >= 2 and all(e["status"] == 400 for e in flushes)
    # Every bucket was answered before the flush failed: the segments stay (a
    # second one may have joined the first, if this sync's packing overlapped a post).
    after = set(own_segments()) - before
    assert len(kept) in (1, 2) and kept <= after and len(after) <= 2
    server.reset()
    await sync.sync_weights()
    assert sync.weight_version == 2
    await sync.shutdown()
    await backend.aclose()


async def test_flush_busy_while_requests_run_is_retried_until_it_succeeds(
    server: Any, make_trainer: Any
) -> None:
    sync, backend = await _synced(server, make_trainer(seed=35))
    server.reset()
    await sync.mark_stale()
    server.fault("/flush_cache", "busy", count=3)
    await sync.sync_weights()
    assert sync.weight_version == 2
    flushes = [e["status"] for e in server.log() if e["path"] == "/flush_cache"]
    assert flushes == [400, 400, 400, 200]
    await backend.aclose()


async def test_wrong_api_key_is_a_clear_error(server: Any, make_trainer: Any) -> None:
    async with SGLangHTTPBackend(server.url, api_key="wrong") as backend:
        sync = HTTPWeightSynchronizer(make_trainer(seed=36), backend)
        with pytest.raises(TransportError, match=r"401 Unauthorized.*wrong key"):
            await sync.init_communicator()
    async with SGLangHTTPBackend(server.url) as backend:
        with pytest.raises(TransportError, match=r"401 Unauthorized.*none sent"):
            await backend.get_weight_version()


async def test_unreachable_server_is_a_transport_error(make_trainer: Any) -> None:
    async with SGLangHTTPBackend("http://127.0.0.1:9", request_timeout_s=2.0) as backend:
        sync = HTTPWeightSynchronizer(make_trainer(seed=37), backend)
        with pytest.raises(TransportError, match="ConnectError"):
            await sync.init_communicator()


async def test_whole_sync_timeout_stops_a_hung_refit(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=38)
    async with SGLangHTTPBackend(server.url, api_key=server.api_key) as backend:
        sync = HTTPWeightSynchronizer(
            trainer, backend, bucket_bytes=BUCKET_BYTES, sync_timeout_s=2.0
        )
        await sync.init_communicator()
        await sync.mark_stale()
        server.fault("/update_weights_from_tensor", "hang", count=1)
        with pytest.raises(SyncTimeoutError, match=r"exceeded 2\.0 s"):
            await sync.sync_weights()
        assert sync.weight_version == 0 and sync.is_stale
        assert trainer.events[-1] == "offload_after"
        server.reset()
        await sync.sync_weights()
        assert sync.weight_version == 1
        state_equal(server.state_dict(), trainer.expected())


async def _interrupted_after_first_bucket(
    server: Any, trainer: Any, state_equal: Any, prompts: list[list[int]], how: str
) -> None:
    """Sync v1, step, then interrupt the v2 sync once bucket 0 was acknowledged.

    The source reaching the first tensor of bucket 2 proves bucket 0 was
    answered: the packer hands bucket 1 over only after the poster finished
    bucket 0 (a zero-capacity stream), and the source is read in plan order.
    At that tensor the source either cancels the caller's scope (``cancel``) or
    stalls past ``sync_timeout_s`` (``timeout``, a slow source).
    """
    sync, backend = await _synced(server, trainer)
    old = trainer.expected()
    plan = sync.plan
    assert len(plan) >= 4
    trigger = plan[2].slots[0].name
    maybe_landed = {s.name for b in plan[:2] for s in b.slots}
    trainer.step(seed=41)
    new = trainer.expected()
    await sync.mark_stale()
    server.reset()
    scope = anyio.CancelScope()
    start = time.monotonic()

    def interrupt(name: str) -> None:
        if name != trigger:
            return
        if how == "cancel":
            # The transport reads the source in a worker thread.
            anyio.from_thread.run_sync(scope.cancel)
        else:
            # A slow source: blocks (its gathers, in the transport's thread) past the limit.
            time.sleep(max(0.0, start + sync.sync_timeout_s - time.monotonic()) + 0.5)

    trainer.on_tensor = interrupt
    if how == "cancel":
        with scope:
            await sync.sync_weights()
        assert scope.cancelled_caught
    else:
        sync.timeouts = dataclasses.replace(sync.timeouts, sync_s=INTERRUPT_SYNC_TIMEOUT_S)
        with pytest.raises(SyncTimeoutError, match=rf"exceeded {INTERRUPT_SYNC_TIMEOUT_S} s"):
            await sync.sync_weights()
    trainer.on_tensor = None

    # The server holds a mix: bucket 0 of v2, the tail still v1.
    held = server.state_dict()
    # It still reports the committed version, in answers too (asked directly:
    # the backend refuses to generate).
    assert [v for _, v in server.generate(prompts, 2)] == ["1"] * len(prompts)
    for slot in plan[0].slots:
        assert torch.equal(held[slot.name], new[slot.name]), slot.name
    for name in set(old) - maybe_landed:
        assert torch.equal(held[name], old[name]), name
    assert await backend.get_weight_version() == "1"
    # ... so nothing may generate from it until a sync lands.
    assert sync.weight_version == 1 and sync.policy_version == 2 and sync.is_stale
    assert backend.weights_valid is False
    with pytest.raises(SyncError, match="did not complete"):
        await backend.generate(prompts, max_new_tokens=4)
    assert trainer.events[-1] == "offload_after"

    server.reset()
    await sync.sync_weights()
    assert sync.weight_version == 2 and not sync.is_stale and backend.weights_valid
    assert await backend.get_weight_version() == "2"
    state_equal(server.state_dict(), new)
    await _serves_v2(backend, trainer, prompts)
    await backend.aclose()


@pytest.mark.parametrize(("how", "seed"), [("cancel", 40), ("timeout", 42)])
async def test_sync_cancelled_or_timed_out_after_a_bucket_landed_refuses_generate_until_a_sync(
    server: Any,
    make_trainer: Any,
    state_equal: Any,
    prompts: list[list[int]],
    how: str,
    seed: int,
) -> None:
    await _interrupted_after_first_bucket(
        server, make_trainer(seed=seed), state_equal, prompts, how
    )


async def test_the_server_reports_the_synchronizers_version_after_every_commit(
    server: Any, make_trainer: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=50)
    sync, backend = await _synced(server, trainer)
    for step in range(3):
        expected = str(sync.weight_version)
        assert await backend.get_weight_version() == expected
        results = await backend.generate_with_meta(prompts, max_new_tokens=3)
        assert [r.weight_version for r in results] == [expected] * len(prompts)
        assert [r.output_ids for r in results] == trainer.reference_generate(prompts, 3)
        # generate() answers the same token ids, without the meta_info.
        assert await backend.generate(prompts, max_new_tokens=3) == [r.output_ids for r in results]
        trainer.step(seed=51 + step)
        await sync.mark_stale()
        await sync.sync_weights()
    assert sync.weight_version == 4
    assert await backend.get_weight_version() == "4"
    await backend.aclose()


async def test_a_failed_flush_leaves_the_committed_version_on_the_server_and_its_answers(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer, sync, backend = await _stale_after_v1(server, make_trainer, seed=52)
    # The server's prefix cache now holds these answers, computed with version 1.
    v1 = await backend.generate(prompts, max_new_tokens=4)
    server.reset()
    server.fault("/flush_cache", "error", count=None)
    with pytest.raises(TransportError, match="/flush_cache did not succeed"):
        await sync.sync_weights()
    assert sync.weight_version == 1 and sync.is_stale
    assert await backend.get_weight_version() == "1"
    # Every bucket of version 2 landed, the flush did not: the cached answers of
    # version 1 are still served, and labelled version 1, not 2.
    assert server.generate(prompts, 4) == [(ids, "1") for ids in v1]
    assert "/update_weight_version" not in [e["path"] for e in server.log()]
    with pytest.raises(SyncError, match="did not complete"):
        await backend.generate(prompts, max_new_tokens=4)
    server.reset()
    await _heals_to_v2(server, trainer, sync, backend, state_equal)
    await _serves_v2(backend, trainer, prompts)
    await backend.aclose()


async def test_a_refused_version_update_fails_the_sync_and_generate_until_a_sync(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer, sync, backend = await _stale_after_v1(server, make_trainer, seed=54)
    server.fault("/update_weight_version", "error", count=1)
    with pytest.raises(TransportError, match="/update_weight_version: HTTP 500"):
        await sync.sync_weights()
    assert sync.weight_version == 1 and sync.is_stale
    assert await backend.get_weight_version() == "1"
    with pytest.raises(SyncError, match="did not complete"):
        await backend.generate(prompts, max_new_tokens=2)
    await _heals_to_v2(server, trainer, sync, backend, state_equal)
    await backend.aclose()
