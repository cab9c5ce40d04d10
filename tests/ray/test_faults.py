"""An engine actor killed mid-sync (``ray.kill``) fails the sync as a dead engine does
in-process: a ``TransportError`` within the sync's limit, the version kept, ``is_stale``
true, the engine refusing to generate. ``respawn_dead_workers()`` brings a new actor (a
relaunch, or Ray's own restart), and after ``init_communicator()`` the next sync heals
it bit for bit; after ``shutdown()`` nothing is left: no actor, no engine process, no
shared memory or socket directory of any of them."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from aiosync import TrainCluster, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.errors import SyncError, TransportError
from aiosync.transports._leftovers import SHM_DIR
from tests._support.sources import HookedSource

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

#: The sync's limit: the dead actor must be reported well before it.
SYNC_TIMEOUT_S = 60.0


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _left_by(pid: int) -> list[str]:
    """What aiosync names after process ``pid`` in /dev/shm and the temp dir."""
    return glob.glob(f"{SHM_DIR}/aiosync-*{pid}-*") + glob.glob(
        f"{tempfile.gettempdir()}/aiosync-*-{pid}-*"
    )


async def _gone(pids: list[int]) -> None:
    """Wait (bounded) until none of ``pids`` runs; assert it."""
    with anyio.move_on_after(60):
        while any(_alive(p) for p in pids):
            await anyio.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def _synchronizer(source: Any, engine: Any, **topology: Any) -> Any:
    """The factory's synchronizer of ``source`` into ``engine`` (``topology``: colocated
    or not): 16 KiB buckets, a sync limit of SYNC_TIMEOUT_S, 30 s RPCs."""
    return create_weight_synchronizer(
        source,
        engine,
        backend="embedded",
        bucket_bytes=16 * 1024,
        sync_timeout_s=SYNC_TIMEOUT_S,
        rpc_timeout_s=30,
        **topology,
    )


@pytest.mark.parametrize(
    ("colocated", "max_restarts"),
    [(True, 0), (False, 1)],
    ids=["ipc-relaunched", "collective-restarted-by-ray"],
)
async def test_an_engine_actor_killed_mid_sync_fails_it_typed_and_a_new_actor_heals(
    ray_cluster: Any, h: SimpleNamespace, colocated: bool, max_restarts: int
) -> None:
    from aiosync.ray import EngineSpec, launch_engine

    ray = ray_cluster
    # What this trainer process already names (engines of earlier tests in the session).
    before = set(_left_by(os.getpid()))
    engine = await launch_engine(
        EngineSpec.embedded(TINY_QWEN3, seed=h.ENGINE_SEED, rpc_timeout_s=30),
        colocated=colocated,
        num_gpus=0,
        num_cpus=0,
        max_restarts=max_restarts,
    )
    trainer = h.trainer_model(21)
    source = HookedSource(trainer.model)
    topology: dict[str, Any] = {}
    if not colocated:
        topology = {"train_cluster": TrainCluster(), "inference_world_size": 1}
    sync = _synchronizer(source, engine, colocated=colocated, **topology)
    async with engine, sync:
        await sync.mark_stale()
        await sync.sync_weights()
        first = engine.info
        workers = engine.pids
        h.advance(trainer.model)
        await sync.mark_stale()

        def kill(i: int) -> None:
            if i == 6:  # buckets have moved: the engine may hold a mix of versions
                ray.kill(engine.actor, no_restart=not max_restarts)
                # ray.kill only asks: under load every bucket could leave and be acked
                # before the actor dies, and the sync would commit, rightly. The next
                # tensor is read once the actor and its workers are gone.
                deadline = time.monotonic() + SYNC_TIMEOUT_S / 2
                while any(map(_alive, [first.pid, *workers])) and time.monotonic() < deadline:
                    time.sleep(0.05)

        source.on_tensor = kill
        with anyio.fail_after(SYNC_TIMEOUT_S), pytest.raises(TransportError) as failed:
            await sync.sync_weights()
        source.on_tensor = lambda i: None
        # IPC: the receive RPC's error, Ray's reason in its message (the transport
        # re-raises its chosen error "from None", which drops the RayActorError it was
        # caused by). Collective: whichever saw it first, the RPC or the collective in
        # flight (gloo's read error: a bucket's broadcast, or the vote's all-gather when
        # every bucket had left before the actor died), as with a worker killed in-process;
        # or, restarted by Ray, the new actor's refusal of a sync it never started.
        seen = str(failed.value)
        assert (
            "died (or is restarting) during collective_rpc(): " in seen
            or (not colocated and seen.startswith(("broadcast of bucket", "control all-gather")))
            # Ray restarted the actor before the sync's next call reached it.
            or (max_restarts and seen.startswith("the engine actor holds no started engine"))
        ), seen
        assert colocated is False or "killed by `ray.kill`" in seen
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (2, 1, True)
        with pytest.raises(TransportError):
            await engine.generate(h.PROMPTS, max_new_tokens=2)
        if getattr(engine, "check_health", None) is not None:  # a fleet's probe says so too
            with pytest.raises(TransportError):
                await engine.check_health()
        await _gone([first.pid, *workers])

        assert await engine.respawn_dead_workers() == [0]
        second = engine.info
        assert second.incarnation != first.incarnation and second.pid != first.pid
        if max_restarts:  # Ray restarted the same actor; else a new actor was launched
            assert second.actor_id == first.actor_id
        else:
            assert second.actor_id != first.actor_id
        # The new engine's start swept the dead one's socket directory.
        assert _left_by(first.pid) == []
        assert (sync.weight_version, sync.is_stale) == (1, True)
        await sync.init_communicator()  # the new worker joins
        await sync.sync_weights()
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (2, 2, False)
        await h.assert_engine_equals(engine, trainer)
        want = trainer.generate(h.PROMPTS, max_new_tokens=3, ignore_eos=True)
        assert await engine.generate(h.PROMPTS, max_new_tokens=3, ignore_eos=True) == want
        workers = engine.pids
    # Nothing left behind: the actor and its engine's processes, and whatever aiosync
    # names after them or after this trainer.
    await _gone([second.pid, *workers])
    with pytest.raises(ray.exceptions.RayActorError):
        await engine.actor.__ray_ready__.remote()
    assert sorted(set(_left_by(os.getpid())) - before) == []
    assert [_left_by(p) for p in (first.pid, second.pid, *workers)] == [[]] * (2 + len(workers))
    with pytest.raises(SyncError, match="shut down"):
        await engine.generate(h.PROMPTS, max_new_tokens=1)


async def test_a_lost_actor_without_relaunch_names_the_way_out(
    ray_cluster: Any, h: SimpleNamespace
) -> None:
    from aiosync.ray import EngineActor, EngineSpec, RayEngine

    ray = ray_cluster
    actor = EngineActor.options(num_cpus=0).remote(EngineSpec("tests.ray._engines:BareEngine"))
    engine = RayEngine(actor, owns_actor=True)
    discarded: list[int] = []
    engine.add_weights_discarded_listener(lambda: discarded.append(1))
    async with engine:
        ray.kill(actor)
        with pytest.raises(TransportError, match="died") as failed:
            await engine.prepare_for_generation()
        assert isinstance(failed.value.__cause__, ray.exceptions.ActorDiedError)
        assert discarded == [1]  # its weights went with it, once
        with pytest.raises(TransportError, match="cannot launch another"):
            await engine.respawn_dead_workers()


async def test_a_fleet_quarantines_an_actor_killed_mid_sync_and_labels_its_survivor(
    ray_cluster: Any, h: SimpleNamespace
) -> None:
    from aiosync import EngineFleet, VersionEventKind
    from aiosync.ray import EngineSpec, launch_engine

    ray = ray_cluster
    spec = EngineSpec.embedded(TINY_QWEN3, seed=h.ENGINE_SEED, rpc_timeout_s=30)
    engines = [await launch_engine(spec, colocated=True, num_gpus=0, num_cpus=0) for _ in "ab"]
    fleet = EngineFleet(engines, on_engine_failure="quarantine", probe_timeout_s=10.0)
    trainer = h.trainer_model(23)
    source = HookedSource(trainer.model)
    sync = _synchronizer(source, fleet, colocated=True)
    victim = "engine 1 of 2 (RayEngine)"
    try:
        async with sync, sync.subscribe() as events:
            await sync.mark_stale()
            await sync.sync_weights()
            h.advance(trainer.model)
            await sync.mark_stale()

            def kill(i: int) -> None:
                if i == 6:  # buckets have moved
                    source.on_tensor = lambda i: None
                    ray.kill(engines[1].actor, no_restart=True)

            source.on_tensor = kill
            # The dead actor's discard notice does not fail the sync it was set aside from.
            await sync.sync_weights()
            assert (sync.policy_version, sync.weight_version, sync.is_stale) == (2, 2, False)
            assert list(fleet.quarantined) == [victim]
            assert "died" in fleet.quarantined[victim]
            assert fleet.serving == [engines[0]]
            seen = []
            async for event in events:
                seen.append((event.kind, event.version, event.engine))
                if event.version == 2 and event.kind in (
                    VersionEventKind.COMMITTED,
                    VersionEventKind.FAILED,
                ):
                    break
            assert (VersionEventKind.ENGINE_QUARANTINED, 2, victim) in seen
            assert seen[-1][:2] == (VersionEventKind.COMMITTED, 2)
            # The survivor holds version 2 and labels what it computes with it.
            await h.assert_engine_equals(engines[0], trainer)
            want = trainer.generate(h.PROMPTS, max_new_tokens=3, ignore_eos=True)
            outs = await fleet.generate_with_meta(h.PROMPTS, max_new_tokens=3, ignore_eos=True)
            assert [g.token_ids for g in outs] == want
            assert [g.versions for g in outs] == [[2, 2, 2]] * len(h.PROMPTS)
    finally:
        for engine in engines:
            await engine.shutdown()
