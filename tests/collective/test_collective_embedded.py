"""The collective transport against the embedded engine (its real worker processes,
``AiosyncWorkerExtension`` mixed in), built through the factory."""

from __future__ import annotations

import anyio
import pytest
import torch
from collective_harness import QWEN3

from aiosync import RefitMismatchError, TrainCluster, create_weight_synchronizer, refit_if_stale
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from tests._support.builders import factory_pick

pytestmark = pytest.mark.slow


async def test_embedded_engine_refits_bit_exact_and_generates_like_the_trainer() -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=200)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    async with EmbeddedEngine(dict(QWEN3), num_workers=2, seed=7) as engine:
        await engine.start()
        for step, overlap in enumerate(["inplace", "staged"]):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1.0 + 0.01 * (step + 1))
            sync = factory_pick(
                DTensorRefitSource(trainer.model),
                engine,
                world_size=2,
                overlap=overlap,
                verify=True,
                collective_timeout_s=60.0,
            )
            assert isinstance(sync, CollectiveWeightSynchronizer)
            async with sync:
                await sync.mark_stale()
                await sync.sync_weights(kv_scales={0: 0.5 + step, 1: 0.25})
                await engine.prepare_for_generation()
                assert sync.weight_version == 1
                assert not await refit_if_stale(sync, engine)
            expected = {n: t.clone() for n, t in DTensorRefitSource(trainer.model).iter_weights()}
            for state in await engine.hf_state_dicts():
                assert list(state) == list(expected)
                assert all(torch.equal(state[n], t) for n, t in expected.items())
            scales = {
                f"model.layers.{i}.self_attn.{kv}_scale": value
                for i, value in ((0, 0.5 + step), (1, 0.25))
                for kv in "kv"
            }
            assert [s["kv_scales"] for s in await engine.status()] == [scales, scales]
            want = trainer.generate(prompts, max_new_tokens=5, ignore_eos=True)
            assert await engine.generate(prompts, max_new_tokens=5, ignore_eos=True) == want


@pytest.mark.parametrize("claimed", [1, 3])
async def test_a_wrong_inference_world_size_is_named_before_the_rendezvous(claimed: int) -> None:
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=201)
    async with EmbeddedEngine(dict(QWEN3), num_workers=2, seed=7) as engine:
        sync = create_weight_synchronizer(
            DTensorRefitSource(trainer.model),
            engine,
            colocated=False,
            backend="embedded",
            train_cluster=TrainCluster(),
            inference_world_size=claimed,
            collective_timeout_s=600.0,  # a rendezvous would hang this long: it must not start
        )
        with anyio.fail_after(120), pytest.raises(ValueError) as raised:
            async with sync:  # initializes: the engine has 2 workers
                pass
    assert str(raised.value) == (
        f"inference_world_size={claimed}, but the engine has 2 worker(s): "
        "pass inference_world_size=2"
    )


class _DiscardingSource(DTensorRefitSource):
    """A trainer whose ``i``-th tensor first makes the engine discard its weights."""

    def __init__(self, model: torch.nn.Module, engine: EmbeddedEngine, at: int) -> None:
        super().__init__(model)
        self.engine, self.at = engine, at

    def iter_weights(self):  # type: ignore[no-untyped-def]
        for i, item in enumerate(super().iter_weights()):
            if i == self.at:
                anyio.from_thread.run(self.engine.finish_generation)  # a level-2 sleep
                self.at = -1
            yield item


async def test_weights_discarded_mid_broadcast_fail_the_sync_and_the_engine_refuses() -> None:
    # Case C14 on the collective: the discard is not lost by the sync's success.
    from aiosync import SyncError

    trainer = HFModelRunner.from_config(dict(QWEN3), seed=202)
    async with EmbeddedEngine(dict(QWEN3), num_workers=1, seed=7, sleep_level=2) as engine:
        source = _DiscardingSource(trainer.model, engine, at=6)
        sync = create_weight_synchronizer(
            source,
            engine,
            colocated=False,
            backend="embedded",
            train_cluster=TrainCluster(),
            inference_world_size=1,
            bucket_bytes=16 * 1024,
            collective_timeout_s=60.0,
        )
        async with sync:
            await sync.mark_stale()
            with pytest.raises(SyncError, match=r"discarded (this worker's|its) weights"):
                await sync.sync_weights()
            assert (sync.weight_version, sync.is_stale) == (0, True)
            await engine.prepare_for_generation()
            assert [s["weights_valid"] for s in await engine.status()] == [False]
            with pytest.raises(SyncError, match="not valid"):
                await engine.generate([[1, 2, 3]], max_new_tokens=2)
            assert await refit_if_stale(sync) is True  # nothing discarded this time
            assert (sync.weight_version, engine.weight_version) == (1, 1)
            [state] = await engine.hf_state_dicts()
            expected = trainer.hf_state_dict()
            assert all(torch.equal(state[n], t) for n, t in expected.items())


async def test_a_drifted_engine_config_is_refused_before_any_worker_joins() -> None:
    # Issue 25 item 5 on the collective: same shapes, another rms_norm_eps.
    trainer = HFModelRunner.from_config(dict(QWEN3), seed=203)
    drifted = {**QWEN3, "rms_norm_eps": 1e-3}
    async with EmbeddedEngine(drifted, num_workers=1, seed=7) as engine:
        [before] = await engine.hf_state_dicts()
        sync = factory_pick(
            DTensorRefitSource(trainer.model),
            engine,
            world_size=1,
            collective_timeout_s=600.0,  # a worker waiting in a rendezvous would hang this long
        )
        with pytest.raises(RefitMismatchError) as info:
            async with sync:
                pytest.fail("init must refuse the drifted engine")
        trainer_eps = trainer.model.config.rms_norm_eps
        assert f"rms_norm_eps: trainer {trainer_eps}, engine 0.001" in str(info.value)
        assert sync.weight_version == 0
        [after] = await engine.hf_state_dicts()
        assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
async def test_a_worker_killed_mid_broadcast_fails_the_sync_at_once_named(overlap: str) -> None:
    import os
    import signal

    from aiosync import TransportError
    from tests._support.sources import HookedSource

    trainer = HFModelRunner.from_config(dict(QWEN3), seed=203)
    source = HookedSource(trainer.model)
    async with EmbeddedEngine(dict(QWEN3), num_workers=2, seed=7, rpc_timeout_s=60) as engine:
        sync = factory_pick(
            source,
            engine,
            world_size=2,
            bucket_bytes=16 * 1024,
            overlap=overlap,
            # Short: a trainer that waited for the dead worker would fail with gloo's
            # timeout (SyncTimeoutError, "Timed out waiting 10000ms"), naming no one.
            collective_timeout_s=10.0,
            rpc_timeout_s=30.0,
        )
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()

            def kill(i: int) -> None:
                if i == 6:  # staged: the stage RPC returned; nothing is in flight
                    source.on_tensor = lambda i: None
                    os.kill(engine.pids[1], signal.SIGKILL)

            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1.5)
            source.on_tensor = kill
            await sync.mark_stale()
            with pytest.raises(TransportError) as failed:
                await sync.sync_weights()
            assert str(failed.value).startswith("engine worker(s) [1] died"), failed.value
            assert (sync.weight_version, sync.is_stale) == (1, True)
            assert await engine.respawn_dead_workers() == [1]
            await sync.init_communicator()
            await sync.sync_weights()
            expected = trainer.hf_state_dict()
            for state in await engine.hf_state_dicts():
                assert all(torch.equal(state[n], t) for n, t in expected.items())
