"""An engine in a Ray actor, driven through :class:`aiosync.ray.RayEngine`, syncs and
generates exactly as the same engine in this process: same capabilities, the same
weights bit for bit, the same greedy tokens, versions and events, over IPC (colocated)
and the collective broadcast."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from aiosync import (
    TrainCluster,
    VersionEventKind,
    capabilities,
    create_weight_synchronizer,
    refit_if_stale,
)
from aiosync.capabilities import (
    ConfigReporting,
    LayoutReporting,
    ManifestReporting,
    ValidityReporting,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.fleet import RespawningEngine
from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError
from aiosync.lora import LoRAChecking, LoRAEngine
from aiosync.refit import DTensorRefitSource
from tests._support.checks import ENGINE_CAPABILITIES

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

#: HealthReporting is new in aiosync.capabilities: checked where the core has it.
HEALTH: tuple[type, ...] = tuple(
    p for p in [getattr(capabilities, "HealthReporting", None)] if p is not None
)
PROTOCOLS: tuple[type, ...] = (
    *HEALTH,
    *ENGINE_CAPABILITIES,
    ValidityReporting,
    ManifestReporting,
    ConfigReporting,
    LayoutReporting,
    RespawningEngine,
    LoRAEngine,
    LoRAChecking,
)


def _claims(engine: object) -> list[str]:
    return [p.__name__ for p in PROTOCOLS if isinstance(engine, p)]


async def test_a_ray_engine_claims_exactly_the_capabilities_of_the_engine_in_its_actor(
    engine: Any,
) -> None:
    local = EmbeddedEngine(TINY_QWEN3)  # not started: isinstance needs no process
    assert _claims(engine) == _claims(local)
    assert engine.info.engine == "EmbeddedEngine"
    assert engine.info.world_size == engine.world_size == 1
    assert engine.tensor_parallel_size == 1 and engine.layout_refusal is None
    assert engine.asleep_tags == frozenset()
    if HEALTH:
        await engine.check_health()  # its worker runs
    # The engine raises in its actor; the caller gets the same type and message.
    with pytest.raises(ValueError) as bad:
        await engine.prepare_for_generation(["bogus"])
    assert str(bad.value) == "unknown tags ['bogus']; known: weights, kv_cache"
    assert bad.value.__notes__ == [
        "raised by EmbeddedEngine.prepare_for_generation in Ray actor "
        f"{engine.info.actor_id} (pid {engine.info.pid})"
    ]


async def test_a_bare_engine_in_an_actor_claims_only_wake_and_sleep(ray_cluster: Any) -> None:
    from aiosync.ray import EngineSpec, launch_engine

    bare = await launch_engine(
        EngineSpec("tests.ray._engines:BareEngine"), colocated=True, num_gpus=0, num_cpus=0
    )
    async with bare:
        # Respawns and discards belong to the actor (it can die), whatever its engine.
        assert _claims(bare) == ["Engine", "DiscardNotifier", "RespawningEngine"]
        assert bare.collective_rpc is None and bare.pause_generation is None
        assert not hasattr(bare, "asleep_tags")
        await bare.finish_generation()
        await bare.prepare_for_generation(["weights"])
        assert await bare.status() == ["sleep", "wake ['weights']"]
        assert await bare.respawn_dead_workers() == []
    with pytest.raises(SyncError, match="shut down"):
        await bare.prepare_for_generation()


async def test_a_call_past_its_limit_is_a_sync_timeout_and_is_cancelled_in_the_actor(
    ray_cluster: Any,
) -> None:
    from aiosync.ray import EngineSpec, launch_engine

    bare = await launch_engine(
        EngineSpec("tests.ray._engines:BareEngine"),
        colocated=True,
        num_gpus=0,
        num_cpus=0,
        call_grace_s=0.5,
    )
    async with bare:
        # The engine's rpc_timeout_s (0.5 s) plus the grace (0.5 s): then the caller gives up.
        with anyio.fail_after(60), pytest.raises(SyncTimeoutError) as late:
            await bare.prepare_for_generation(["hang"])
        assert str(late.value).endswith("did not answer prepare_for_generation() within 1.0 s")
        with anyio.fail_after(60):
            while await bare.status() != ["wake ['hang']", "cancelled"]:
                await anyio.sleep(0.05)


async def test_an_engine_error_in_the_actor_arrives_with_its_type_and_message(
    ray_cluster: Any, h: SimpleNamespace
) -> None:
    from aiosync.ray import EngineSpec, launch_engine

    trainer = h.trainer_model(13)
    drifted = {**TINY_QWEN3, "rms_norm_eps": 1e-3}  # same shapes, another config
    engine = await launch_engine(
        EngineSpec.embedded(drifted, seed=h.ENGINE_SEED), colocated=True, num_gpus=0, num_cpus=0
    )
    async with engine:
        sync = create_weight_synchronizer(
            DTensorRefitSource(trainer.model), engine, colocated=True, backend="embedded"
        )
        with pytest.raises(RefitMismatchError) as refused:
            async with sync:
                pytest.fail("init must refuse the drifted engine")
    eps = trainer.model.config.rms_norm_eps
    assert f"rms_norm_eps: trainer {eps}, engine 0.001" in str(refused.value)
    assert sync.weight_version == 0


async def _scenario(
    engine: Any, h: SimpleNamespace, *, colocated: bool, seed: int, base: int
) -> dict[str, Any]:
    """From version ``base`` (the session's engine only sees versions go up), two
    syncs (the second after a step, a sleep and a wake) and what they left: versions,
    events (kind, version, bytes, delta), the engine's tokens and their labels."""
    trainer = h.trainer_model(seed)
    topology: dict[str, Any] = {}
    if not colocated:
        topology = {"train_cluster": TrainCluster(), "inference_world_size": 1}
    sync = create_weight_synchronizer(
        DTensorRefitSource(trainer.model),
        engine,
        colocated=colocated,
        backend="embedded",
        bucket_bytes=64 * 1024,
        initial_version=base,
        **topology,
    )
    seen: dict[str, Any] = {"class": type(sync).__name__, "versions": [], "greedy": []}
    events = sync.subscribe()
    async with sync:  # its shutdown ends the subscription after the buffered events
        await sync.mark_stale()  # the engine booted with its own weights
        for step in range(2):
            if step:
                async with sync.policy_update():
                    h.advance(trainer.model)
                await engine.finish_generation()  # the colocated bracket wakes it
            assert await refit_if_stale(sync, engine)
            await h.assert_engine_equals(engine, trainer)
            want = trainer.generate(h.PROMPTS, max_new_tokens=4, ignore_eos=True)
            outs = await engine.generate_with_meta(h.PROMPTS, max_new_tokens=4, ignore_eos=True)
            assert [g.token_ids for g in outs] == want
            seen["greedy"].append([(g.token_ids, g.first_version, g.last_version) for g in outs])
            seen["versions"].append(
                (sync.policy_version, sync.weight_version, sync.is_stale, engine.weight_version)
            )
        seen["asleep"] = engine.asleep_tags
    seen["events"] = [(ev.kind, ev.version, ev.nbytes, ev.delta) async for ev in events]
    return seen


@pytest.mark.parametrize(("colocated", "base"), [(True, 0), (False, 10)], ids=["ipc", "collective"])
async def test_syncs_into_an_engine_actor_match_the_same_syncs_in_process(
    engine: Any, h: SimpleNamespace, colocated: bool, base: int
) -> None:
    through_ray = await _scenario(engine, h, colocated=colocated, seed=11, base=base)
    async with EmbeddedEngine(TINY_QWEN3, seed=h.ENGINE_SEED) as local:
        in_process = await _scenario(local, h, colocated=colocated, seed=11, base=base)
    assert through_ray == in_process
    expected = "IPCWeightSynchronizer" if colocated else "CollectiveWeightSynchronizer"
    assert through_ray["class"] == expected
    one, two = base + 1, base + 2
    assert through_ray["versions"] == [(one, one, False, one), (two, two, False, two)]
    assert [labels for _, *labels in through_ray["greedy"][1]] == [[two, two]] * len(h.PROMPTS)
    kinds = [(kind, version) for kind, version, _, _ in through_ray["events"]]
    assert kinds == [
        (VersionEventKind.STALE, one),
        (VersionEventKind.SYNC_STARTED, one),
        (VersionEventKind.COMMITTED, one),
        (VersionEventKind.STALE, two),
        (VersionEventKind.SYNC_STARTED, two),
        (VersionEventKind.COMMITTED, two),
    ]
    full = sum(t.numel() * t.element_size() for t in h.trainer_model(11).hf_state_dict().values())
    assert [nbytes for kind, _, nbytes, _ in through_ray["events"] if kind.name == "COMMITTED"] == [
        full,
        full,
    ]
    assert through_ray["asleep"] == frozenset()


async def test_weights_discarded_in_the_actor_make_the_synchronizer_stale_until_a_sync(
    ray_cluster: Any, h: SimpleNamespace
) -> None:
    from aiosync.ray import EngineSpec, launch_engine

    engine = await launch_engine(
        EngineSpec.embedded(TINY_QWEN3, seed=h.ENGINE_SEED, sleep_level=2),
        colocated=True,
        num_gpus=0,
        num_cpus=0,
    )
    trainer = h.trainer_model(12)
    sync = create_weight_synchronizer(
        DTensorRefitSource(trainer.model), engine, colocated=True, backend="embedded"
    )
    async with engine, sync:
        await sync.mark_stale()
        assert await refit_if_stale(sync, engine)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        # A level-2 sleep zeroes the weights in the actor's worker: the listener the
        # synchronizer registered here runs when the call returns.
        await engine.finish_generation()
        assert engine.asleep_tags == frozenset({"weights", "kv_cache"})
        assert (sync.weight_version, sync.is_stale) == (1, True)
        await engine.prepare_for_generation()
        assert [s["weights_valid"] for s in await engine.status()] == [False]
        with pytest.raises(SyncError, match="not valid"):
            await engine.generate(h.PROMPTS, max_new_tokens=2)
        assert await refit_if_stale(sync, engine)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await h.assert_engine_equals(engine, trainer)
