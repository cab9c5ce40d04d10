"""Disaggregated SGLang: ``SGLangCollectiveWeightSynchronizer`` against real test-server
processes that join SGLang's weight-update group (gloo, loopback) and receive every
bucket's broadcast for real.

Two servers of two TP ranks each form one group with the trainer (world 5, rank
offsets 1 and 3); a sessionless server (an SGLang before the weight-update session)
takes the same refit. ``GLOO_SOCKET_IFNAME=lo`` keeps every gloo socket on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiosync import (
    EngineFleet,
    RefitMismatchError,
    SGLangCollectiveWeightSynchronizer,
    SGLangHTTPBackend,
    SyncError,
    TrainCluster,
    VersionEventKind,
    create_weight_synchronizer,
)
from tests._support.steps import first_sync

from .conftest import TestServer, fleet_sync, reset_around, serve_pair

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
DISTRIBUTED = "/update_weights_from_distributed"


@pytest.fixture(scope="module")
def loopback_gloo() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield


@pytest.fixture(scope="module")
def tp2_pair(
    loopback_gloo: None, server_workdir: Path, dense_config: Path
) -> Iterator[tuple[TestServer, TestServer]]:
    """Two servers of two TP ranks each (they inherit ``GLOO_SOCKET_IFNAME``)."""
    yield from serve_pair(server_workdir, dense_config, "--tp-size", "2")


@pytest.fixture
def pair(tp2_pair: tuple[TestServer, TestServer]) -> Iterator[tuple[TestServer, TestServer]]:
    yield from reset_around(tp2_pair)


def _fleet(servers: Any, trainer: Any, **options: Any) -> Any:
    """SGLang's collective over ``servers`` (:func:`fleet_sync`, gloo)."""
    options.setdefault("inference_world_size", 2 * len(servers))
    cluster = TrainCluster(master_addr="127.0.0.1")
    return fleet_sync(
        servers,
        trainer,
        colocated=False,
        train_cluster=cluster,
        dist_backend="gloo",
        bucket_bytes=BUCKET_BYTES,
        **options,
    )


def _entries(server: TestServer, path: str) -> list[dict[str, Any]]:
    return [e for e in server.log() if e["path"] == path]


async def test_a_fleet_of_two_tp2_servers_receives_every_broadcast_bit_exact_on_every_rank(
    pair: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=70)
    async with _fleet(pair, trainer) as (sync, backends):
        assert isinstance(sync, SGLangCollectiveWeightSynchronizer)
        await sync.init_communicator()
        for step in range(2):
            await sync.mark_stale()
            await sync.sync_weights(kv_scales={1: 0.5})
            assert (sync.weight_version, sync.is_stale) == (step + 1, False)
            for server, backend in zip(pair, backends, strict=True):
                for rank in (0, 1):
                    state_equal(server.state_dict(rank), trainer.expected())
                assert server.kv_scales()[1]["model.layers.1.self_attn.k_scale"] == 0.5
                assert await backend.get_weight_version() == str(step + 1)
            assert await sync.generation.generate(
                prompts, max_new_tokens=4
            ) == trainer.reference_generate(prompts, 4)
            trainer.step(seed=71 + step)
        group = sync.group_name
    for offset, server in zip((1, 3), pair, strict=True):
        (init,) = _entries(server, "/init_weights_update_group")
        assert (init["status"], init["rank_offset"], init["world_size"]) == (200, offset, 5)
        assert (init["group_name"], init["backend"]) == (group, "gloo")
        updates = _entries(server, DISTRIBUTED)
        # Every bucket and the scales' own, each sync, all inside the session.
        assert len(updates) == 2 * (len(sync.plan) + 1)
        assert all(e["status"] == 200 and e["group_name"] == group for e in updates)
        order = [e["path"] for e in server.log()]
        first, last = order.index("/begin_weight_update"), order.index("/end_weight_update")
        assert first < order.index(DISTRIBUTED) < last < order.index("/update_weight_version")
        assert [e["status"] for e in _entries(server, "/destroy_weights_update_group")] == [200]


async def test_the_colocated_http_refit_of_the_same_fleet_lands_on_every_rank_too(
    pair: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=75)
    backends = [SGLangHTTPBackend(s.url) for s in pair]
    sync = create_weight_synchronizer(
        trainer, backends, colocated=True, backend="sglang", bucket_bytes=BUCKET_BYTES
    )
    try:
        await first_sync(sync)
        for server in pair:
            for rank in (0, 1):
                state_equal(server.state_dict(rank), trainer.expected())
            assert [e["entries"] for e in _entries(server, "/update_weights_from_tensor")] == [
                2
            ] * len(sync.plan)
    finally:
        await sync.shutdown()
        for backend in backends:
            await backend.aclose()


async def test_a_sync_failing_half_way_ends_the_sessions_commits_nothing_and_the_next_reforms(
    pair: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=80)
    async with _fleet(pair, trainer) as (sync, backends):
        await first_sync(sync)
        first_group = sync.group_name
        trainer.step(seed=81)
        names = list(trainer.prepare_refit_info())

        def fail_half_way(name: str) -> None:
            if name == names[len(names) // 2]:
                raise RuntimeError("the trainer's gather failed")

        trainer.on_tensor = fail_half_way
        await sync.mark_stale()
        with pytest.raises(RuntimeError, match="the trainer's gather failed"):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        for server, backend in zip(pair, backends, strict=True):
            # The failed sync's session: some buckets landed, the session was ended and no
            # version label followed it. The log is in completion order, so a bucket cut off
            # by the failure may answer (400) after the end.
            log = server.log()
            paths = [e["path"] for e in log]
            failed = log[len(log) - 1 - paths[::-1].index("/begin_weight_update") :]
            assert 200 in {e["status"] for e in failed if e["path"] == DISTRIBUTED}
            after = [e["path"] for e in failed]
            assert "/end_weight_update" in after and "/update_weight_version" not in after
            assert await backend.get_weight_version() == "1"
            with pytest.raises(SyncError, match="holds no valid weights"):
                await backend.generate(prompts, max_new_tokens=2)
        trainer.on_tensor = None
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert sync.group_name == f"{first_group}-1"  # formed again over the same store
        for server in pair:
            for rank in (0, 1):
                state_equal(server.state_dict(rank), trainer.expected())
        assert await sync.generation.generate(
            prompts, max_new_tokens=4
        ) == trainer.reference_generate(prompts, 4)


async def test_a_world_size_that_differs_from_the_servers_is_refused_before_any_rendezvous(
    pair: Any, make_trainer: Any
) -> None:
    async with _fleet(pair, make_trainer(seed=90), inference_world_size=2) as (sync, _):
        with pytest.raises(RefitMismatchError, match=r"inference_world_size=2.*4 ranks"):
            await sync.init_communicator()
        assert sync.master_port is None
    assert [_entries(s, "/init_weights_update_group") for s in pair] == [[], []]


async def test_a_server_without_the_session_routes_is_refit_sessionless(
    loopback_gloo: None,
    server_workdir: Path,
    dense_config: Path,
    make_trainer: Any,
    state_equal: Any,
) -> None:
    server = TestServer(server_workdir, dense_config, "--no-weight-update-session")
    try:
        trainer = make_trainer(seed=95)
        async with _fleet([server], trainer, inference_world_size=1) as (sync, backends):
            await first_sync(sync)
            assert backends[0].weight_update_session is False
            state_equal(server.state_dict(), trainer.expected())
            assert await backends[0].get_weight_version() == "1"
        paths = [e["path"] for e in server.log()]
        assert DISTRIBUTED in paths and "/end_weight_update" not in paths
    finally:
        server.close()
    assert os.environ.get("GLOO_SOCKET_IFNAME") == "lo"


async def test_a_server_killed_mid_sync_is_quarantined_the_group_reformed_and_a_new_one_joins(
    loopback_gloo: None,
    server_workdir: Path,
    dense_config: Path,
    make_trainer: Any,
    state_equal: Any,
    prompts: list[list[int]],
) -> None:
    # Short receive limits: the survivor's broadcast cut off by the death waits that long
    # (holding its update lock) before the group can be formed again without the dead one.
    limit = ("--weights-update-timeout-s", "5")
    first = TestServer(server_workdir, dense_config, *limit)
    second = TestServer(server_workdir, dense_config, *limit)
    joined: TestServer | None = None
    backends = [SGLangHTTPBackend(s.url) for s in (first, second)]
    fleet = EngineFleet(backends, on_engine_failure="quarantine", probe_timeout_s=10.0)
    trainer = make_trainer(seed=98)
    sync = create_weight_synchronizer(
        trainer,
        fleet,
        colocated=False,
        backend="sglang",
        train_cluster=TrainCluster(master_addr="127.0.0.1"),
        inference_world_size=2,
        dist_backend="gloo",
        bucket_bytes=BUCKET_BYTES,
        collective_timeout_s=5.0,
    )
    try:
        async with sync, sync.subscribe() as events:
            await sync.mark_stale()
            await sync.sync_weights()
            names = list(trainer.expected())

            def kill(name: str) -> None:
                if name == names[len(names) // 2]:
                    trainer.on_tensor = None
                    second.proc.kill()
                    second.proc.join()

            trainer.step(seed=99)
            trainer.on_tensor = kill
            await sync.mark_stale()
            await sync.sync_weights()  # commits on the first server alone
            assert (sync.weight_version, sync.is_stale) == (2, False)
            victim = "engine 1 of 2 (SGLangHTTPBackend)"
            assert list(fleet.quarantined) == [victim]
            state_equal(first.state_dict(), trainer.expected())
            assert await backends[0].get_weight_version() == "2"
            kinds = []
            while (event := await events.__anext__()).version < 2 or (
                event.kind is not VersionEventKind.COMMITTED
            ):
                kinds.append((event.kind, event.engine))
            assert (VersionEventKind.ENGINE_QUARANTINED, victim) in kinds
            assert await fleet.generate(prompts, max_new_tokens=4) == trainer.reference_generate(
                prompts, 4
            )
            # The group held the trainer and the survivor only.
            init = _entries(first, "/init_weights_update_group")[-1]
            assert (init["status"], init["world_size"], init["rank_offset"]) == (200, 2, 1)

            # A new server joins: the next sync forms the group over both and gives it
            # the full weights; only then is it in service.
            joined = TestServer(server_workdir, dense_config, *limit)
            newcomer = SGLangHTTPBackend(joined.url)
            backends.append(newcomer)
            fleet.add_engine(newcomer)
            assert fleet.serving == [backends[0]]
            trainer.step(seed=100)
            await sync.mark_stale()
            await sync.sync_weights()
            assert fleet.serving == [backends[0], newcomer]
            for server in (first, joined):
                state_equal(server.state_dict(), trainer.expected())
            assert await newcomer.get_weight_version() == "3"
            init = _entries(joined, "/init_weights_update_group")[-1]
            assert (init["status"], init["world_size"], init["rank_offset"]) == (200, 3, 2)
    finally:
        for backend in backends:
            await backend.aclose()
        for server in (first, second, joined):
            if server is not None:
                server.close()


#: A trainer process that syncs the servers once, shuts down and exits.
_SYNC_AND_EXIT = """
import sys, anyio, httpx, torch
import aiosync
from aiosync.testing import StateDictSource

async def main(urls):
    raw = httpx.get(urls[0] + "/_aiosync/manifest", timeout=60).json()
    manifest = {name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in raw}
    backends = [aiosync.SGLangHTTPBackend(url) for url in urls]
    sync = aiosync.create_weight_synchronizer(
        StateDictSource.random(manifest), backends, colocated=False, backend="sglang",
        train_cluster=aiosync.TrainCluster(master_addr="127.0.0.1"),
        inference_world_size=4, dist_backend="gloo")
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        print("version", sync.weight_version, flush=True)
    for backend in backends:
        await backend.aclose()

anyio.run(main, sys.argv[1:])
"""


def test_a_trainer_process_that_synced_exits_cleanly(pair: Any) -> None:
    # The group's backend is closed by shutdown(), not left to a thread that the
    # interpreter's exit would catch inside gloo ("terminate called ...", rc 134).
    out = subprocess.run(
        [sys.executable, "-c", _SYNC_AND_EXIT, *(s.url for s in pair)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert (out.returncode, out.stdout.split()) == (0, ["version", "1"]), out.stderr[-2000:]
    assert "terminate called" not in out.stderr
