"""Several SGLang servers refit as one fleet: two real test-server processes.

``create_weight_synchronizer(policy, [a, b], colocated=True, backend="sglang")``
wraps the backends in an ``EngineFleet``; the HTTP synchronizer posts every
bucket to both servers, and ``weight_version`` advances only once both flushed
and took the version.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import pytest

from aiosync import (
    EngineFleet,
    SGLangHTTPBackend,
    SyncError,
    TransportError,
)
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http._segment import own_segments
from tests._support.steps import first_sync, sync_catching
from tests.http.conftest import fleet_sync

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
#: Bound on waiting for a server to see a request (a hang guard, not a measurement), s.
SEEN_WITHIN_S = 60.0


#: What ``sync_weights(kv_scales={1: 0.25})`` loads on every server.
LAYER_1_SCALES = {
    "model.layers.1.self_attn.k_scale": 0.25,
    "model.layers.1.self_attn.v_scale": 0.25,
}


def _fleet(servers: Any, trainer: Any) -> Any:
    return fleet_sync(servers, trainer, colocated=True, bucket_bytes=BUCKET_BYTES)


def _updates(server: Any) -> list[dict[str, Any]]:
    return [e for e in server.log() if e["path"] == "/update_weights_from_tensor"]


async def test_one_sync_refits_both_servers_bit_exact_and_both_report_its_version(
    servers: Any,
    make_trainer: Any,
    state_equal: Any,
    prompts: list[list[int]],
    mapped_segments: Any,
) -> None:
    trainer = make_trainer(seed=60)
    before = set(own_segments())
    async with _fleet(servers, trainer) as (sync, backends):
        assert isinstance(sync, HTTPWeightSynchronizer)
        assert isinstance(sync.generation, EngineFleet)
        assert sync.servers == tuple(backends)
        await sync.init_communicator()
        # Scales a sync does not name stay as they were (an earlier test's, on these
        # session-wide servers): layer 1's are set, the rest unchanged.
        scales = [[{**rank, **LAYER_1_SCALES} for rank in server.kv_scales()] for server in servers]
        for step in range(2):
            await sync.mark_stale()
            await sync.sync_weights(kv_scales={1: 0.25})
            assert sync.weight_version == step + 1 and not sync.is_stale
            for server, backend, expected in zip(servers, backends, scales, strict=True):
                state_equal(server.state_dict(), trainer.expected())
                assert server.kv_scales() == expected
                assert await backend.get_weight_version() == str(step + 1)
                results = await backend.generate_with_meta(prompts, max_new_tokens=4)
                assert [r.weight_version for r in results] == [str(step + 1)] * len(prompts)
            # The fleet splits the prompts over both servers; each answers as the trainer.
            assert await sync.generation.generate(
                prompts, max_new_tokens=4
            ) == trainer.reference_generate(prompts, 4)
            trainer.step(seed=61 + step)
        # Between syncs the synchronizer keeps its bucket segments (two when one was
        # packed while the servers loaded the other) mapped for the next sync; both
        # servers dropped their mappings before they answered.
        assert len(set(own_segments()) - before) in (1, 2)
        assert [mapped_segments(server.proc.pid) for server in servers] == [set(), set()]
    assert set(own_segments()) - before == set()  # shutdown unlinked them
    for server in servers:
        # Every bucket (and the scales' own) went to every server, then flush, then version.
        updates = _updates(server)
        assert len(updates) == 2 * (len(sync.plan) + 1)
        assert all(e["status"] == 200 and e["entries"] == 1 for e in updates)
        refit = {"/update_weights_from_tensor", "/flush_cache", "/update_weight_version"}
        log = [(e["path"], e.get("new_version")) for e in server.log() if e["path"] in refit]
        tail = log[-3:]
        assert tail == [
            ("/update_weights_from_tensor", None),
            ("/flush_cache", None),
            ("/update_weight_version", "2"),
        ]


async def test_a_bucket_reaches_both_servers_before_the_next_and_one_failure_fails_all(
    servers: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=62)
    first, second = servers
    before = set(own_segments())
    async with _fleet(servers, trainer) as (sync, backends):
        await first_sync(sync)
        assert len(sync.plan) >= 2
        trainer.step(seed=63)
        await sync.mark_stale()
        for server in servers:
            server.reset()
        # Server 1 holds bucket 0 unanswered; server 0 answers it.
        second.fault("/update_weights_from_tensor", "hang", count=1)
        failure: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(sync_catching, sync, failure, TransportError)
            with anyio.fail_after(SEEN_WITHIN_S):
                while not (_updates(first) and _updates(second)):
                    await anyio.sleep(0.05)
            # Posted to both at once; bucket 1 waits for server 1's answer.
            assert [e["status"] for e in _updates(first)] == [200]
            assert [e["status"] for e in _updates(second)] == ["hung"]
            second.reset()  # the hung request now answers 503: the sync fails
        (error,) = failure
        assert re.match(r"SGLang server 1 of 2 \(http://127\.0\.0\.1:\d+\): ", str(error))
        assert second.url in str(error) and "HTTP 503" in str(error)
        assert [len(_updates(s)) for s in servers] == [1, 1]  # bucket 1 never moved
        assert sync.weight_version == 1 and sync.is_stale
        for backend in backends:
            assert await backend.get_weight_version() == "1"
            assert not backend.weights_valid
            with pytest.raises(SyncError, match="did not complete"):
                await backend.generate(prompts, max_new_tokens=2)
        with pytest.raises(SyncError, match=r"engine 0 of 2 \(SGLangHTTPBackend\)"):
            await sync.generation.generate(prompts, max_new_tokens=2)
        # Server 1 may still decode bucket 0 later: the failure unlinked every segment
        # (none is written again), the kept ones of the first sync included.
        assert set(own_segments()) - before == set()

        # A sync lands: both servers serve the new version.
        await sync.sync_weights()
        assert sync.weight_version == 2 and not sync.is_stale
        for server, backend in zip(servers, backends, strict=True):
            state_equal(server.state_dict(), trainer.expected())
            assert await backend.get_weight_version() == "2"
        assert await sync.generation.generate(
            prompts, max_new_tokens=3
        ) == trainer.reference_generate(prompts, 3)


async def test_a_flush_failing_on_one_server_leaves_neither_reporting_the_version(
    servers: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=64)
    first, _ = servers
    async with _fleet(servers, trainer) as (sync, backends):
        for backend in backends:
            backend.flush_timeout_s = 1.0
        await first_sync(sync)
        trainer.step(seed=65)
        await sync.mark_stale()
        first.fault("/flush_cache", "error", count=None)
        with pytest.raises(TransportError, match=r"^SGLang server 0 of 2 .*/flush_cache did not"):
            await sync.sync_weights()
        assert sync.weight_version == 1 and sync.is_stale
        assert [await b.get_weight_version() for b in backends] == ["1", "1"]
        first.reset()
        await sync.sync_weights()
        assert [await b.get_weight_version() for b in backends] == ["2", "2"]
        for server in servers:
            state_equal(server.state_dict(), trainer.expected())


def test_what_is_not_a_fleet_of_sglang_servers_is_refused(make_trainer: Any) -> None:
    trainer = make_trainer(seed=66)
    backend = SGLangHTTPBackend("http://127.0.0.1:9")
    with pytest.raises(TypeError, match=r"engine 1 of 2 is not an SGLang server .*lacks"):
        HTTPWeightSynchronizer(trainer, EngineFleet([backend, object()]))
    with pytest.raises(ValueError, match="appears twice"):
        HTTPWeightSynchronizer(trainer, [backend, backend])
    with pytest.raises(TypeError, match=r"got object, which lacks .*update_weight_version"):
        HTTPWeightSynchronizer(trainer, object())
