"""IPC refits into real embedded-engine processes: bit-exact weights, generation, lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.events import VersionEventKind
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.steps import first_sync, sleep_at_level_2

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIFECYCLE = [
    "offload_before_refit",
    "prepare_for_generation(weights)",
    "stream",
    "offload_after_refit",
    "prepare_for_generation(kv_cache)",
]


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"aiosync-{os.getpid()}-*")}


async def test_sync_moe_into_two_engines_is_bit_exact_and_generates_like_trainer(
    moe_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.MOE, seed=11)
    log: list[str] = []
    # 12 KiB buckets: dozens of buckets through two ping-pong buffers, while the
    # embedding, lm_head, q/o projections (32 KiB) travel alone, each in a
    # buffer of its own (C1).
    sync = IPCWeightSynchronizer(
        h.TrainerSource(trainer.model, log),
        h.RecordingEngine(moe_engine, log),
        bucket_bytes=12288,
        rpc_timeout_s=60,
    )
    async with sync, sync.subscribe() as events:
        await sync.init_communicator()
        assert sync.num_workers == 2
        assert sync.plan is not None
        oversized = [b for b in sync.plan.buckets if b.nbytes > 12288]
        assert all(len(b.slots) == 1 for b in oversized)
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= {
            b.slots[0].name for b in oversized
        }
        assert len(sync.plan.buckets) - len(oversized) > 4
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await h.assert_engine_serves(moe_engine, trainer, tokens=6)
        kinds = [(await anext(events)).kind for _ in range(3)]
        assert kinds == [
            VersionEventKind.STALE,
            VersionEventKind.SYNC_STARTED,
            VersionEventKind.COMMITTED,
        ]
        assert log == LIFECYCLE


async def test_sync_tied_dense_sends_embedding_once_and_reaches_engine(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=12)
    async with h.ipc_sync(trainer, dense_engine, bucket_bytes=1 << 20) as sync:
        await sync.init_communicator()
        assert sync.plan is not None
        names = list(sync.plan.manifest())
        assert "lm_head.weight" not in names
        assert names.count("model.embed_tokens.weight") == 1
        await sync.mark_stale()
        await sync.sync_weights()
        await h.assert_engine_serves(dense_engine, trainer, tokens=5)


async def test_slow_receiver_gets_uncorrupted_weights(
    moe_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # C11: both workers are repeatedly frozen while the trainer streams; a
    # buffer reused before the worker's ack would land the next bucket's bytes
    # in this bucket's tensors.
    trainer = h.trainer_model(h.MOE, seed=13)
    stop = asyncio.Event()

    async def stutter() -> None:
        while not stop.is_set():
            for pid in moe_engine.pids:
                os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(0.05)
            for pid in moe_engine.pids:
                os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.01)

    async with h.ipc_sync(trainer, moe_engine, bucket_bytes=4096, rpc_timeout_s=60) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        task = asyncio.create_task(stutter())
        try:
            await sync.sync_weights()
        finally:
            stop.set()
            await task
            for pid in moe_engine.pids:
                os.kill(pid, signal.SIGCONT)
        await h.assert_engine_equals(moe_engine, trainer)


async def test_lifecycle_order_holds_when_the_sync_fails(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=14)
    log: list[str] = []

    def fail(i: int) -> None:
        if i == 5:
            raise RuntimeError("trainer-side failure while streaming")

    source = h.TrainerSource(trainer.model, log, on_tensor=fail)
    engine = h.RecordingEngine(dense_engine, log)
    async with IPCWeightSynchronizer(source, engine, bucket_bytes=8192, rpc_timeout_s=30) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        with pytest.raises(RuntimeError, match="trainer-side failure"):
            await sync.sync_weights()
        assert log == LIFECYCLE
        assert (sync.weight_version, sync.is_stale) == (0, True)
        # The engine saw part of the refit: it must not serve the half-updated model.
        with pytest.raises(Exception, match="not valid"):
            await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
        source.on_tensor = None
        log.clear()
        await sync.sync_weights()
        assert log == LIFECYCLE
        assert (sync.weight_version, sync.is_stale) == (1, False)
        await h.assert_engine_equals(dense_engine, trainer)


async def test_level2_sleep_marks_engine_stale_until_a_sync(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # C6: weights discarded while the trainer ran, then woken without a sync.
    trainer = h.trainer_model(h.DENSE_TIED, seed=15)
    async with h.ipc_sync(trainer, dense_engine, bucket_bytes=1 << 20) as sync:
        await first_sync(sync)
        await sleep_at_level_2(dense_engine)
        await dense_engine.prepare_for_generation()
        assert sync.is_stale
        assert sync.weight_version == 1
        with pytest.raises(Exception, match="not valid"):
            await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
        await sync.sync_weights()
        assert not sync.is_stale
        await h.assert_engine_equals(dense_engine, trainer)


async def test_the_default_bucket_is_a_share_of_free_memory_lifted_to_the_4_mib_floor(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # KV scales on every transport: aiosync.testing.conformance's kv_scales cell.
    trainer = h.trainer_model(h.DENSE_TIED, seed=16)
    # No bucket_bytes: a share of the free memory, cut to an eighth of this tiny
    # manifest, which the 4 MiB floor of the default then lifts.
    async with h.ipc_sync(trainer, dense_engine) as sync:
        await sync.init_communicator()
        assert sync.plan is not None
        assert sync.plan.bucket_bytes == 4 * 1024**2
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        await h.assert_engine_equals(dense_engine, trainer)


async def test_socket_dir_is_private_and_removed_with_buffers_on_shutdown(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=17)
    before = _segments()
    sync = h.ipc_sync(trainer, dense_engine, bucket_bytes=16384)
    await sync.init_communicator()
    directory = sync.socket_dir
    assert directory is not None
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert (Path(directory) / "refit.sock").exists()
    created = _segments() - before
    assert len(created) == 2  # the ping-pong pair
    for name in created:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
    await sync.mark_stale()
    await sync.sync_weights()
    await sync.shutdown()
    assert not Path(directory).exists()
    assert _segments() - before == set()
    await sync.shutdown()  # idempotent


async def test_an_optimizer_step_during_a_refit_waits_so_the_engine_gets_one_version(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # The mixed-version case: a step landing while the refit streams must not leave the
    # engine with tensors of two versions (it served "v2" whose tensors were mostly v3).
    import threading

    import torch

    trainer = h.trainer_model(h.DENSE_TIED, seed=33)
    streaming = threading.Event()

    def slow(i: int) -> None:
        if i == 3:
            streaming.set()
        time.sleep(0.02)

    source = h.TrainerSource(trainer.model, [], on_tensor=slow)
    async with IPCWeightSynchronizer(source, dense_engine, bucket_bytes=4096) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        before = trainer.hf_state_dict()

        async def step() -> None:
            await anyio.to_thread.run_sync(streaming.wait)
            async with sync.policy_update():
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.mul_(2.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            await sync.sync_weights()
        assert (sync.weight_version, sync.policy_version) == (1, 2)
        [state] = await dense_engine.hf_state_dicts()
        assert all(torch.equal(state[n], t) for n, t in before.items())  # all of version 1
        await sync.sync_weights()
        await h.assert_engine_equals(dense_engine, trainer)  # then all of version 2
