"""HTTPWeightSynchronizer against a real test-server process (no memory saver, TP=2)."""

from __future__ import annotations

import base64
import os
import pickle
from typing import Any

import pytest
import torch

from aiosync import (
    RefitMismatchError,
    SGLangHTTPBackend,
    TransportError,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http._segment import own_segments
from aiosync.transports.http._wire import (
    allocate_flat,
    group_flat,
    pack_flat,
    plan_flat_buckets,
    serialize_flat,
)
from tests.http.conftest import BUCKET_BYTES, http_sync

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tp2_server: Any) -> Any:
    tp2_server.reset()
    return tp2_server


async def test_sync_is_bit_exact_and_server_reports_our_version(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=7)
    backend = SGLangHTTPBackend(server.url)
    sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
    await sync.init_communicator()
    assert backend.tp_size == 2  # read from /get_server_info
    await sync.mark_stale()
    await sync.sync_weights()
    assert sync.weight_version == 1 and not sync.is_stale
    state_equal(server.state_dict(), trainer.expected())
    assert await backend.get_weight_version() == "1"

    trainer.step(seed=11)
    await sync.mark_stale()
    await sync.sync_weights()
    state_equal(server.state_dict(), trainer.expected())
    assert await backend.get_weight_version() == "2"
    await backend.aclose()
    await sync.shutdown()


async def test_every_tp_rank_loads_its_own_entry_and_both_ranks_are_bit_exact(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=22)
    async with http_sync(server.url, trainer) as (_, sync):
        pass
    expected = trainer.expected()
    state_equal(server.state_dict(rank=0), expected)
    state_equal(server.state_dict(rank=1), expected)
    updates = [e for e in server.log() if e["path"] == "/update_weights_from_tensor"]
    assert [e["entries"] for e in updates] == [2] * len(sync.plan)


async def test_entry_r_of_serialized_named_tensors_is_what_tp_rank_r_loads(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    # Two trainers' buckets in one request: rank 0 must load the first's, rank 1 the second's.
    first, second = make_trainer(seed=23), make_trainer(seed=24)
    manifest = {n: (tuple(s), d) for n, (s, d) in first.prepare_refit_info().items()}
    plan = plan_flat_buckets(manifest, BUCKET_BYTES)
    streams = zip(
        group_flat(first.inner.iter_weights(), plan, manifest),
        group_flat(second.inner.iter_weights(), plan, manifest),
        strict=True,
    )
    for (bucket, ours), (_, theirs) in streams:
        flats = [allocate_flat(bucket, torch.device("cpu")) for _ in range(2)]
        pack_flat(bucket, ours, flats[0].tensor)
        pack_flat(bucket, theirs, flats[1].tensor)
        body = {
            "serialized_named_tensors": [serialize_flat(bucket, flat) for flat in flats],
            "load_format": "flattened_bucket",
            "flush_cache": False,
        }
        # SGLang 0.5.23: every update inside a weight-update session.
        server.admin.post("/begin_weight_update", json={}).raise_for_status()
        response = server.admin.post("/update_weights_from_tensor", json=body)
        server.admin.post("/end_weight_update", json={}).raise_for_status()
        for flat in flats:
            flat.release()
        assert response.status_code == 200, response.text
    rank0, rank1 = server.state_dict(rank=0), server.state_dict(rank=1)
    state_equal(rank0, first.expected())
    state_equal(rank1, second.expected())
    assert sum(not torch.equal(rank0[n], rank1[n]) for n in rank0) > len(rank0) // 2


async def test_every_bucket_is_one_request_with_one_entry_per_rank(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=8)
    async with http_sync(server.url, trainer, synced=False) as (_, sync):
        await sync.mark_stale(5)
        await sync.sync_weights()
    updates = [e for e in server.log() if e["path"] == "/update_weights_from_tensor"]
    assert len(updates) == len(sync.plan) > 1
    assert all(e["entries"] == 2 and e["status"] == 200 for e in updates)
    assert all(e["load_format"] == "flattened_bucket" for e in updates)
    # flush_cache=True would make SGLang assert inside the update: always False.
    assert all(e["flush_cache"] is False for e in updates)
    # No bucket carries the version: SGLang would report it before the flush.
    assert all("weight_version" not in e for e in updates)
    log = server.log()
    # The version is set once every bucket landed and the cache was flushed; then
    # the sync resumes the generation it paused (the in-flight policy).
    assert [e["path"] for e in log[-3:]] == [
        "/flush_cache",
        "/update_weight_version",
        "/continue_generation",
    ]
    assert log[-2]["new_version"] == "5" and log[-2]["abort_all_requests"] is False
    assert log[-2]["status"] == 200
    assert trainer.events == ["offload_before", "stream", "offload_after"]


async def test_two_kept_segments_carry_every_bucket_of_every_sync_until_shutdown(
    server: Any, make_trainer: Any, state_equal: Any, mapped_segments: Any
) -> None:
    trainer = make_trainer(seed=9)
    before = set(own_segments())
    seen: list[set[str]] = []
    # When the source is asked for a tensor, at most one bucket is in flight and
    # one is being gathered: never more than two segments exist.
    trainer.on_tensor = lambda name: seen.append(set(own_segments()) - before)
    async with http_sync(server.url, trainer, synced=False) as (_, sync):
        assert len(sync.plan) > 2
        for step in range(2):
            await sync.mark_stale()
            await sync.sync_weights()
            # Packed into memory that held the previous buckets: still bit-exact.
            state_equal(server.state_dict(rank=0), trainer.expected())
            state_equal(server.state_dict(rank=1), trainer.expected())
            trainer.step(seed=90 + step)
        kept = set(own_segments()) - before
        # Two when a bucket was packed while the previous one was in flight; one
        # when the server always answered first (timing): never more.
        assert len(kept) in (1, 2)
        # Every bucket of both syncs went through the same two files. (Read before
        # its bucket's segment is taken, the last tensor may be the first to see a
        # segment, so the reads see a subset of the two.)
        assert set().union(*seen) <= kept
        assert all(len(segments) <= 2 for segments in seen)
        assert len(seen) == 2 * len(trainer.prepare_refit_info())
        # Reused only because the server answered after dropping its views.
        assert mapped_segments(server.proc.pid) == set()
        await sync.shutdown()
    assert set(own_segments()) - before == set()


async def test_greedy_generation_equals_the_trainers_and_no_stale_prefix_survives(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=12)
    async with http_sync(server.url, trainer) as (backend, sync):
        first = await backend.generate(prompts, max_new_tokens=6)
        assert first == trainer.reference_generate(prompts, 6)
        # The server now caches these prompts, computed with version 1 (C7).
        trainer.step(seed=13)
        await sync.mark_stale()
        await sync.sync_weights()
        second = await backend.generate(prompts, max_new_tokens=6)
        assert second == trainer.reference_generate(prompts, 6)
        assert second != first


async def test_kv_scales_land_exactly_after_the_weights_and_generation_still_matches(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=14)
    async with http_sync(server.url, trainer, synced=False) as (backend, sync):
        await sync.mark_stale()
        await sync.sync_weights(kv_scales={0: 0.5, "model.layers.1.self_attn.v_scale": 0.1})
        assert sync.weight_version == 1 and not sync.is_stale
        expected = {
            "model.layers.0.self_attn.k_scale": 0.5,
            "model.layers.0.self_attn.v_scale": 0.5,
            # Sent as float32: 0.1 rounded to the nearest float32.
            "model.layers.1.self_attn.v_scale": float(torch.tensor(0.1, dtype=torch.float32)),
        }
        assert server.kv_scales() == [expected, expected]  # on both TP ranks
        state_equal(server.state_dict(), trainer.expected())
        assert await backend.generate(prompts, max_new_tokens=5) == trainer.reference_generate(
            prompts, 5
        )
    updates = [e for e in server.log() if e["path"] == "/update_weights_from_tensor"]
    # One bucket per plan entry, then the scales' own bucket, all answered.
    assert len(updates) == len(sync.plan) + 1
    assert all(e["status"] == 200 and e["entries"] == 2 for e in updates)


@pytest.mark.parametrize(
    ("kv_scales", "error", "match"),
    [
        ({7: 0.5}, ValueError, r"layer index 7 is not an attention layer .*layers with "
         r"self_attn: 0, 1\)"),
        ({"model.layers.9.self_attn.k_scale": 0.5}, RefitMismatchError, r"no 'model\.layers\.9"),
        ({"model.layers.0.mlp.k_scale": 0.5}, ValueError, "neither a layer index"),
    ],
)  # fmt: skip
async def test_a_bad_kv_scale_is_refused_before_any_request_and_versions_stay(
    server: Any, make_trainer: Any, state_equal: Any, kv_scales: Any, error: Any, match: str
) -> None:
    trainer = make_trainer(seed=18)
    async with http_sync(server.url, trainer) as (backend, sync):
        held = server.state_dict()
        trainer.step(seed=19)
        await sync.mark_stale()
        server.reset()
        with pytest.raises(error, match=match):
            await sync.sync_weights(kv_scales=kv_scales)
        assert sync.weight_version == 1 and sync.policy_version == 2 and sync.is_stale
        assert server.log() == []  # not one request: nothing moved
        assert await backend.get_weight_version() == "1"
        state_equal(server.state_dict(), held)
        assert backend.weights_valid  # the server still holds version 1, whole


async def test_factory_builds_the_http_synchronizer_for_colocated_sglang(
    server: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=15)
    async with SGLangHTTPBackend(server.url) as backend:
        sync = create_weight_synchronizer(
            trainer, backend, colocated=True, backend="sglang", bucket_bytes=BUCKET_BYTES
        )
        assert isinstance(sync, HTTPWeightSynchronizer)
        await sync.init_communicator()
        async with sync.subscribe() as events:
            await sync.mark_stale()
            await sync.sync_weights()
            kinds = [(await events.__anext__()).kind for _ in range(3)]
        assert kinds == [
            VersionEventKind.STALE,
            VersionEventKind.SYNC_STARTED,
            VersionEventKind.COMMITTED,
        ]
        state_equal(server.state_dict(), trainer.expected())


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /dev/null",))


async def test_malicious_pickle_is_rejected_and_weights_unchanged(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    before = server.state_dict()
    payload = base64.b64encode(pickle.dumps({"flattened_tensor": _Evil(), "metadata": []})).decode()
    body = {
        "serialized_named_tensors": [payload, payload],
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "weight_version": "666",
    }
    server.admin.post("/begin_weight_update", json={}).raise_for_status()
    response = server.admin.post("/update_weights_from_tensor", json=body)
    server.admin.post("/end_weight_update", json={}).raise_for_status()
    assert response.status_code == 400
    assert response.json()["success"] is False
    assert "forbidden global" in response.json()["message"]
    assert "system" in response.json()["message"]
    assert server.admin.get("/model_info").json()["weight_version"] != "666"
    state_equal(server.state_dict(), before)


async def test_wrong_tp_size_is_refused_by_the_server_with_its_message(
    server: Any, make_trainer: Any
) -> None:
    async with SGLangHTTPBackend(server.url, tp_size=1) as backend:
        sync = HTTPWeightSynchronizer(make_trainer(seed=16), backend)
        await sync.init_communicator()
        await sync.mark_stale()
        with pytest.raises(TransportError, match=r"needs 2 entries \(one per TP rank\), got 1"):
            await sync.sync_weights()
        assert sync.weight_version == 0 and sync.is_stale


async def test_a_source_that_drifts_from_its_manifest_raises_refit_mismatch(
    server: Any, make_trainer: Any
) -> None:
    trainer = make_trainer(seed=17)
    names = list(trainer.prepare_refit_info())

    def drift(name: str) -> None:
        if name == names[-1]:
            raise RefitMismatchError(f"{name}: drifted")

    trainer.on_tensor = drift
    async with http_sync(server.url, trainer, synced=False) as (_, sync):
        await sync.mark_stale()
        with pytest.raises(RefitMismatchError, match="drifted"):
            await sync.sync_weights()
        assert sync.weight_version == 0 and sync.is_stale
    # The last bucket never moved: the server does not report the version.
    updates = [e for e in server.log() if e["path"] == "/update_weights_from_tensor"]
    assert all(e.get("weight_version") is None for e in updates)
    paths = [e["path"] for e in server.log()]
    assert "/flush_cache" not in paths and "/update_weight_version" not in paths
