"""An elastic fleet of SGLang servers: two real test-server processes behind
``EngineFleet(on_engine_failure="quarantine")``. One server SIGKILLed mid-sync fails its
health check (``GET /health``), is set aside, and the same ``sync_weights()`` commits on
the other (bit-exact, its version reported); a new server added with ``add_engine`` joins
with the next sync and serves only once it committed. A server dead before a sync fails
the pause and is set aside as well."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from aiosync import EngineFleet, SGLangHTTPBackend, VersionEventKind, create_weight_synchronizer

from .conftest import TestServer

pytestmark = pytest.mark.slow


_FleetOfTwo = tuple[list[TestServer], list[SGLangHTTPBackend], EngineFleet, Any, Any, Any]


@pytest.fixture
def fleet_of_two(
    server_workdir: Path, dense_config: Path, make_trainer: Any
) -> Callable[[int], AbstractAsyncContextManager[_FleetOfTwo]]:
    """``fleet_of_two(seed)``: two test servers behind
    ``EngineFleet(on_engine_failure="quarantine")``, a trainer (``seed``) and its
    colocated SGLang synchronizer (64 KiB buckets), entered and subscribed to (its
    events come last). Every server and backend in the lists it yields is closed
    after, added ones too."""
    return partial(_quarantining_fleet, server_workdir, dense_config, make_trainer)


@asynccontextmanager
async def _quarantining_fleet(
    workdir: Path, config: Path, make_trainer: Any, seed: int
) -> AsyncIterator[_FleetOfTwo]:
    servers = [TestServer(workdir, config) for _ in range(2)]
    backends = [SGLangHTTPBackend(s.url) for s in servers]
    fleet = EngineFleet(backends, on_engine_failure="quarantine", probe_timeout_s=10.0)
    trainer = make_trainer(seed=seed)
    sync = create_weight_synchronizer(
        trainer, fleet, colocated=True, backend="sglang", bucket_bytes=64 * 1024
    )
    try:
        async with sync, sync.subscribe() as events:
            yield servers, backends, fleet, trainer, sync, events
    finally:
        for backend in backends:
            await backend.aclose()
        for server in servers:
            server.close()


async def test_a_server_killed_mid_sync_is_quarantined_and_a_new_one_joins(
    fleet_of_two: Any,
    server_workdir: Path,
    dense_config: Path,
    state_equal: Any,
    prompts: list[list[int]],
) -> None:
    async with fleet_of_two(70) as (servers, backends, fleet, trainer, sync, events):
        await sync.mark_stale()
        await sync.sync_weights()
        while (await events.__anext__()).kind is not VersionEventKind.COMMITTED:
            pass
        names = list(trainer.expected())

        def kill(name: str) -> None:
            if name == names[len(names) // 2]:
                trainer.on_tensor = None
                servers[1].proc.kill()
                servers[1].proc.join()

        trainer.step(seed=71)
        trainer.on_tensor = kill
        await sync.mark_stale()
        await sync.sync_weights()  # commits on server 0
        assert (sync.weight_version, sync.is_stale) == (2, False)
        victim = "engine 1 of 2 (SGLangHTTPBackend)"
        assert list(fleet.quarantined) == [victim]
        assert fleet.serving == [backends[0]]
        state_equal(servers[0].state_dict(), trainer.expected())
        assert await backends[0].get_weight_version() == "2"
        seen = []
        while (event := await events.__anext__()).kind is not VersionEventKind.COMMITTED:
            seen.append((event.kind, event.engine))
        assert (VersionEventKind.ENGINE_QUARANTINED, victim) in seen
        assert await fleet.generate(prompts, max_new_tokens=4) == trainer.reference_generate(
            prompts, 4
        )

        joined = TestServer(server_workdir, dense_config)
        servers.append(joined)
        newcomer = SGLangHTTPBackend(joined.url)
        backends.append(newcomer)
        fleet.add_engine(newcomer)
        assert fleet.serving == [backends[0]]  # joining: no generate calls yet
        trainer.step(seed=72)
        await sync.mark_stale()
        await sync.sync_weights()
        assert fleet.serving == [backends[0], newcomer]
        for server in (servers[0], joined):
            state_equal(server.state_dict(), trainer.expected())
        assert await newcomer.get_weight_version() == "3"
        while (event := await events.__anext__()).kind is not VersionEventKind.ENGINE_JOINED:
            pass
        assert (event.version, event.engine) == (3, "engine 2 of 3 (SGLangHTTPBackend)")


async def test_a_server_dead_between_syncs_is_quarantined_and_the_other_commits_and_serves(
    fleet_of_two: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    async with fleet_of_two(73) as (servers, backends, fleet, trainer, sync, events):
        await sync.mark_stale()
        await sync.sync_weights()
        servers[1].proc.kill()
        servers[1].proc.join()
        trainer.step(seed=74)
        await sync.mark_stale()
        # Its pause fails (nothing answers): it is set aside, server 0 commits.
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        victim = "engine 1 of 2 (SGLangHTTPBackend)"
        assert list(fleet.quarantined) == [victim]
        assert "ConnectError" in fleet.quarantined[victim]
        assert fleet.serving == [backends[0]]
        seen = []
        async for event in events:
            seen.append((event.kind, event.version, event.engine))
            if event.kind is VersionEventKind.COMMITTED and event.version == 2:
                break
        assert (VersionEventKind.ENGINE_QUARANTINED, 2, victim) in seen
        state_equal(servers[0].state_dict(), trainer.expected())
        assert await backends[0].get_weight_version() == "2"
        assert await fleet.generate(prompts, max_new_tokens=4) == trainer.reference_generate(
            prompts, 4
        )
