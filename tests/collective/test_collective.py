"""CollectiveWeightSynchronizer end to end: one trainer (this process) and spawned
inference workers over real gloo process groups on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import anyio
import pytest
import torch
import torch.distributed as dist
from anyio import create_task_group as anyio_task_group
from collective_harness import (
    PROMPTS,
    QWEN3,
    QWEN3_MOE,
    RecordingWorkers,
    WorkerPool,
    Workers,
    assert_bit_exact,
)

from aiosync import (
    EventSubscription,
    RefitMismatchError,
    RefitVerificationError,
    TrainCluster,
    TransportError,
    VersionEventKind,
)
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from tests._support.steps import first_sync

pytestmark = pytest.mark.slow


def _trainer(config: dict[str, object], seed: int = 100) -> HFModelRunner:
    return HFModelRunner.from_config(dict(config), seed=seed)


def _checkpoint(runner: HFModelRunner) -> dict[str, torch.Tensor]:
    """The trainer's weights as the refit source sends them."""
    return {n: t.clone() for n, t in DTensorRefitSource(runner.model).iter_weights()}


def _sync(
    runner: HFModelRunner, workers: Workers, port: int, **options: object
) -> CollectiveWeightSynchronizer:
    return CollectiveWeightSynchronizer(
        DTensorRefitSource(runner.model),
        workers,
        train_cluster=TrainCluster(master_port=port),
        inference_world_size=len(workers.indices),
        collective_timeout_s=60.0,
        rpc_timeout_s=60.0,
        **options,  # type: ignore[arg-type]
    )


async def _generates_greedily(pool: WorkerPool, worker: int, trainer: HFModelRunner) -> None:
    """Worker ``worker`` generates the trainer's greedy tokens for PROMPTS (6 each)."""
    expected = trainer.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    assert await pool.call(worker, "test_generate", prompts=PROMPTS, max_new_tokens=6) == expected


def _perturb(runner: HFModelRunner, seed: int) -> None:
    """An optimizer step: every weight changes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in runner.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


async def test_sync_one_worker_bit_exact_with_kv_scales_and_same_greedy_output(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3)
    workers = await pool.view([0])
    before = await pool.call(0, "test_state_dict")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[name], _checkpoint(trainer)[name])  # the sync must change it
    async with _sync(trainer, workers, free_port) as sync:
        await sync.mark_stale()
        await sync.sync_weights(kv_scales={0: 0.5, 1: 0.25})
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (1, 1, False)
        await sync.mark_stale()
        with pytest.raises(ValueError, match="neither a layer index"):
            await sync.sync_weights(kv_scales={"layers.0.k_scale": 0.5})
        assert (sync.weight_version, sync.is_stale) == (1, True)
    await assert_bit_exact(pool, [0], _checkpoint(trainer))
    assert await pool.call(0, "test_kv_scales") == {
        "model.layers.0.self_attn.k_scale": 0.5,
        "model.layers.0.self_attn.v_scale": 0.5,
        "model.layers.1.self_attn.k_scale": 0.25,
        "model.layers.1.self_attn.v_scale": 0.25,
    }
    await _generates_greedily(pool, 0, trainer)


async def test_sync_three_workers_bit_exact_with_verify_and_oversized_tensor(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=101)
    workers = await pool.view([0, 1, 2])
    # 16 KiB buckets: many buckets in flight, and the 32 KiB embedding and
    # lm_head each travel alone in a larger buffer (case C1).
    async with _sync(trainer, workers, free_port, verify=True, bucket_bytes=16 * 1024) as sync:
        assert len(sync.plan.buckets) > 10
        assert sync.plan.max_bucket_nbytes > 16 * 1024
        events = sync.subscribe()
        for step in (1, 2):
            _perturb(trainer, seed=step)
            await sync.mark_stale()
            await sync.sync_weights()
            assert sync.weight_version == step
            await assert_bit_exact(pool, [0, 1, 2], _checkpoint(trainer))
            results = sync.last_worker_results
            assert [r["version"] for r in results] == [step] * 3
            assert len({tuple(r["checksums"]) for r in results}) == 1
            assert len(results[0]["checksums"]) == len(sync.plan.buckets)
    kinds = [e.kind async for e in events]
    assert kinds.count(VersionEventKind.COMMITTED) == 2
    assert VersionEventKind.FAILED not in kinds


async def test_staged_overlap_gives_the_same_weights_and_generation_runs_meanwhile(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=102)
    workers = await pool.view([0, 1, 2])
    async with _sync(trainer, workers, free_port, overlap="staged", verify=True) as sync:
        await sync.mark_stale()
        # Generation keeps running on the live weights while buckets land.
        await pool.call(0, "test_generate", prompts=PROMPTS, max_new_tokens=2)
        await sync.sync_weights(kv_scales={1: 0.125})
        assert sync.weight_version == 1
        assert all(r["pause_s"] >= 0 for r in sync.last_worker_results)
    await assert_bit_exact(pool, [0, 1, 2], _checkpoint(trainer))
    scales = await pool.call(2, "test_kv_scales")
    assert scales["model.layers.1.self_attn.k_scale"] == 0.125
    assert scales["model.layers.1.self_attn.v_scale"] == 0.125
    await _generates_greedily(pool, 1, trainer)


async def test_sync_qwen3_moe_per_expert_names_bit_exact(pool: WorkerPool, free_port: int) -> None:
    trainer = _trainer(QWEN3_MOE, seed=103)
    workers = await pool.view([4])
    async with _sync(trainer, workers, free_port, bucket_bytes=64 * 1024) as sync:
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in sync.plan.manifest()
        await sync.mark_stale()
        await sync.sync_weights()
    await assert_bit_exact(pool, [4], _checkpoint(trainer))
    await _generates_greedily(pool, 4, trainer)


async def test_manifest_mismatch_on_one_receiver_raises_on_every_rank(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=104)
    workers = await pool.view([0, 1, 3])  # worker 3's MLP is narrower
    sync = _sync(trainer, workers, free_port)
    start = time.monotonic()
    with pytest.raises(RefitMismatchError) as info:
        await sync.init_communicator()
    assert time.monotonic() - start < 60  # nobody waited for a collective timeout
    assert "inference rank 2" in str(info.value)
    assert "mlp.gate_proj.weight" in str(info.value)
    assert sorted(workers.last_errors) == [0, 1, 2]
    assert all(isinstance(e, RefitMismatchError) for e in workers.last_errors.values())
    # No rank kept a group: a receive fails at once everywhere.
    for i in (0, 1, 3):
        with pytest.raises(TransportError, match="no sync group"):
            await pool.call(i, "aiosync_collective_receive", version=1, kv_names=[])
    await sync.shutdown()


async def test_default_process_groups_still_work_after_the_sync_group_is_destroyed(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=105)
    workers = await pool.view([0, 1, 2])
    # The engine's own group (like vLLM's TP group) and the trainer's, on other ports.
    engine_port, trainer_port = free_port + 1, free_port + 2
    async with anyio_task_group() as tg:
        for i in (0, 1, 2):
            tg.start_soon(
                lambda i=i: pool.call(i, "test_init_default_group", port=engine_port, world_size=3)
            )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=0, world_size=1
    )
    try:
        async with _sync(trainer, workers, free_port) as sync:
            await sync.mark_stale()
            await sync.sync_weights()
        await assert_bit_exact(pool, [0, 1, 2], _checkpoint(trainer))
        sums = [0, 0, 0]

        async def reduce(i: int) -> None:
            sums[i] = await pool.call(i, "test_default_all_reduce")

        async with anyio_task_group() as tg:
            for i in (0, 1, 2):
                tg.start_soon(reduce, i)
        assert sums == [6, 6, 6]
        t = torch.tensor([5])
        dist.all_reduce(t)
        assert int(t) == 5 and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
        for i in (0, 1, 2):
            await pool.call(i, "test_destroy_default_group")


async def test_receiver_killed_mid_broadcast_keeps_version_then_reformed_group_syncs(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=106)
    workers = await pool.view([0, 1, 2])
    sync = _sync(trainer, workers, free_port, bucket_bytes=16 * 1024)
    # Short: a trainer that waited for the dead worker in the broadcast would fail
    # with gloo's timeout ("Timed out waiting 10000ms"), not the worker's death.
    sync.collective_timeout_s = 10.0
    try:
        await first_sync(sync)
        _perturb(trainer, seed=7)
        await sync.mark_stale()
        await pool.call(2, "test_arm_crash", after_loads=3)  # dies at its 4th bucket
        with pytest.raises(TransportError) as failed:
            await sync.sync_weights()
        # The error is the dead worker's, in its message (not a note), not gloo's.
        assert str(failed.value) == "worker 2 died during aiosync_collective_receive"
        assert not pool.is_alive(2)
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        # The survivors' receives failed too and they dropped the broken group.
        for i in (0, 1):
            with pytest.raises(TransportError):
                await pool.call(i, "test_generate", prompts=PROMPTS, max_new_tokens=1)
        # The engine knows worker 2 is gone: the next sync fails at once, naming
        # it, instead of waiting at the rendezvous for a rank that never comes.
        with pytest.raises(TransportError, match="worker 2 is gone"):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        pool.restart(2)
        await pool.call(2, "test_set_rank", rank=2)
        await sync.init_communicator()  # re-forms the group
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        await assert_bit_exact(pool, [0, 1, 2], _checkpoint(trainer))
    finally:
        await sync.shutdown()


#: A trainer in its own process: forms a 2-rank sync group with one engine worker, then
#: SIGKILLs itself in the middle of the stream of version 1 (no handler runs).
_DYING_TRAINER = r"""
import json, os, signal, sys
import torch
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.transports.collective._group import STATUS_OK, create_sync_group, open_store
from aiosync.transports.collective._loops import RotatingBuffers, stream_buckets
from aiosync.transports.packing import plan_buckets
config, timeout_s = json.loads(sys.argv[1])
source = DTensorRefitSource(HFModelRunner.from_config(config, seed=3).model)
plan = plan_buckets(source.prepare_refit_info(), 16 * 1024)
store = open_store("127.0.0.1", 0, is_master=True, timeout_s=timeout_s)
print(json.dumps({"port": store.port, "plan": plan.to_json()}), flush=True)
group = create_sync_group(store=store, rank=0, world_size=2, train_world_size=1,
    backend="gloo", device=torch.device("cpu"), timeout_s=timeout_s, session="orphan")
group.agree(STATUS_OK, "", plan.digest)
def weights():
    for i, item in enumerate(source.iter_weights()):
        if i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        yield item
stream_buckets(group, plan, RotatingBuffers(plan, torch.device("cpu")), weights(),
    version=1, kv=[], verify=False)
"""


async def test_trainer_sigkilled_mid_broadcast_ends_the_worker_receive_without_a_timeout(
    pool: WorkerPool,
) -> None:
    # The group allows 60 s; the RPC 15 s. A worker that waited for the dead trainer
    # in the broadcast, or in tearing down the group it left (gloo's destructor waits
    # for the receive posted ahead), would answer after the RPC's SyncTimeoutError.
    child = await anyio.open_process(
        [sys.executable, "-c", _DYING_TRAINER, json.dumps([QWEN3, 60.0])],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await child.stdout.receive()
        info = json.loads(line)
        await pool.call(
            0,
            "aiosync_collective_init",
            master_addr="127.0.0.1",
            master_port=info["port"],
            world_size=2,
            train_world_size=1,
            backend="gloo",
            plan=info["plan"],
            timeout_s=60.0,
            session="orphan",
            owner="dying-trainer",
        )
        receive = {"version": 1, "kv_names": [], "verify": False, "owner": "dying-trainer"}
        with pytest.raises(TransportError, match=r"trainer rank 0 is gone|Connection"):
            await pool.call_with_timeout(0, "aiosync_collective_receive", receive, 15.0)
        assert await child.wait() == -signal.SIGKILL
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    # The worker left the broken group and refuses to generate on half a version.
    with pytest.raises(TransportError, match="no sync group"):
        await pool.call(0, "aiosync_collective_held_version", owner="dying-trainer")
    with pytest.raises(TransportError, match="weights invalid"):
        await pool.call(0, "test_generate", prompts=PROMPTS, max_new_tokens=1)


async def test_verify_catches_a_communicator_that_silently_moves_nothing(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=107)
    workers = await pool.view([0])
    async with _sync(trainer, workers, free_port, bucket_bytes=64 * 1024, verify=False) as sync:
        await pool.call(0, "test_drop_bucket_data")
        # Without verification the broken communicator goes unnoticed...
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        got = await pool.call(0, "test_state_dict")
        expected = _checkpoint(trainer)
        assert not all(torch.equal(got[n], t) for n, t in expected.items())
        # ...with it (the default sample), the refit fails loudly and the version stays.
        sync.verify = "sample"
        await sync.mark_stale()
        with pytest.raises(
            RefitVerificationError, match=r"engine worker 0: bucket \d+ .* arrived with digest"
        ):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)


def _pending(events: EventSubscription) -> list[tuple[VersionEventKind, int]]:
    """The events published so far and not yet read, as ``(kind, version)``."""
    out = []
    while (event := events.receive_nowait()) is not None:
        out.append((event.kind, event.version))
    return out


_BAD_KV_SCALES: list[tuple[dict[int | str, float], type[Exception], str]] = [
    ({-3: 1.0}, ValueError, "layer index must be >= 0, got -3"),
    ({999: 1.0}, ValueError, "layer index 999 is not an attention layer"),
    ({2: 1.0}, ValueError, "layer index 2 is not an attention layer"),
    ({"model.layers.7.self_attn.v_scale": 1.0}, RefitMismatchError, "no 'model.layers.7"),
]


async def test_kv_scale_keys_unknown_to_the_manifest_raise_before_any_byte_moves(
    pool: WorkerPool, free_port: int
) -> None:
    trainer = _trainer(QWEN3, seed=109)
    workers = RecordingWorkers(await pool.view([0]))
    async with _sync(trainer, workers, free_port) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        old = _checkpoint(trainer)
        old_runner = _trainer(QWEN3)
        old_runner.load_weights(iter(old.items()))
        expected = old_runner.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        _perturb(trainer, seed=9)
        events = sync.subscribe()
        await sync.mark_stale()
        for kv_scales, error, match in _BAD_KV_SCALES:
            workers.methods.clear()
            with pytest.raises(error, match=match):
                await sync.sync_weights(kv_scales=kv_scales)
            assert workers.methods == []  # no RPC, so no receive started on the engine
            assert (sync.weight_version, sync.is_stale) == (1, True)
            # The engine kept its old, valid weights and still generates with them.
            await assert_bit_exact(pool, [0], old)
            got = await pool.call(0, "test_generate", prompts=PROMPTS, max_new_tokens=4)
            assert got == expected
        # Only the trainer's step was published while the bad scales were refused.
        assert _pending(events) == [(VersionEventKind.STALE, 2)]
        await sync.sync_weights(kv_scales={1: 0.75})
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert _pending(events) == [
            (VersionEventKind.SYNC_STARTED, 2),
            (VersionEventKind.COMMITTED, 2),
        ]
    await assert_bit_exact(pool, [0], _checkpoint(trainer))
    scales = await pool.call(0, "test_kv_scales")
    assert scales["model.layers.1.self_attn.k_scale"] == 0.75
