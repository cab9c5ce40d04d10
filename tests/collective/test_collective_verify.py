"""Verified refits on the collective transport (``verify=``): a byte flipped in transit.

The fault is the workers' own test hook (``aiosync_test_arm_transit_fault``): it
flips one byte of one received bucket before the worker loads it, as a transport
that corrupts what it delivers would. With a check the sync fails on every rank
with :class:`~aiosync.RefitVerificationError` naming the worker, the bucket and its
first tensor, before any worker counts its weights valid; without one the
corruption reaches the engine's weights, at exactly that byte.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest
import torch
from collective_harness import PROMPTS, QWEN3, WorkerPool, Workers, assert_bit_exact

from aiosync import (
    RefitVerificationError,
    SyncError,
    TrainCluster,
    TransportError,
    VersionEventKind,
)
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit.torch_source import DTensorRefitSource
from aiosync.transports._verify import sample_key, sample_positions
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.packing import Bucket, BucketPlan, TensorSlot

pytestmark = pytest.mark.slow

#: Small buckets: many of them, several tensors in some.
BUCKET_BYTES = 16 * 1024
#: The worker the fault is armed on (worker 0 receives intact buckets).
FAULTY = 1


@pytest.fixture(scope="module")
def verify_pool() -> Iterator[WorkerPool]:
    """Two engine workers holding the trainer's architecture."""
    workers = WorkerPool([QWEN3, QWEN3], seed=1)
    try:
        yield workers
    finally:
        workers.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trainer(seed: int) -> HFModelRunner:
    return HFModelRunner.from_config(dict(QWEN3), seed=seed)


def _checkpoint(runner: HFModelRunner) -> dict[str, torch.Tensor]:
    """The trainer's weights as the refit source sends them."""
    return {n: t.clone() for n, t in DTensorRefitSource(runner.model).iter_weights()}


def _perturb(runner: HFModelRunner, seed: int) -> None:
    """An optimizer step: every weight changes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in runner.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


def _sync(
    runner: HFModelRunner, workers: Workers, **options: object
) -> CollectiveWeightSynchronizer:
    return CollectiveWeightSynchronizer(
        DTensorRefitSource(runner.model),
        workers,
        train_cluster=TrainCluster(master_port=_port()),
        inference_world_size=len(workers.indices),
        bucket_bytes=BUCKET_BYTES,
        collective_timeout_s=60.0,
        rpc_timeout_s=60.0,
        **options,  # type: ignore[arg-type]
    )


def _second_slot(plan: BucketPlan) -> tuple[Bucket, TensorSlot]:
    """The first bucket holding several tensors, and its second tensor's slot."""
    bucket = next(b for b in plan.buckets if len(b.slots) >= 3 and b.slots[1].nbytes >= 8)
    return bucket, bucket.slots[1]


def _unsampled_byte(plan: BucketPlan, version: int) -> tuple[Bucket, int]:
    """A bucket and a byte in the second half of one of its tensors that the sample
    of ``version`` leaves out (a bucket of at most ``SAMPLE_BYTES`` bytes has none)."""
    for bucket in plan.buckets:
        slots = [(s.offset, s.nbytes) for s in bucket.slots]
        sampled = set(
            sample_positions(bucket.nbytes, sample_key(version, bucket.index), slots).tolist()
        )
        for slot in bucket.slots:
            for byte in range(slot.offset + slot.nbytes // 2, slot.offset + slot.nbytes - 1):
                if byte not in sampled:
                    return bucket, byte
    raise AssertionError("every byte of the plan is sampled")


def _names(bucket: Bucket) -> str:
    """How the error names the bucket's tensors."""
    if len(bucket.slots) == 1:
        return repr(bucket.slots[0].name)
    return f"{bucket.slots[0].name!r} and {len(bucket.slots) - 1} more"


async def _arm(pool: WorkerPool, worker: int, bucket: int, byte: int, mask: int = 0xFF) -> None:
    await pool.call(worker, "aiosync_test_arm_transit_fault", bucket=bucket, byte=byte, mask=mask)


def _unsampled_exponent(plan: BucketPlan, version: int) -> tuple[Bucket, TensorSlot, int]:
    """A bucket, one of its float tensors and the byte of that tensor holding an
    element's top exponent bits (bit 6 of its last byte, little-endian), which the
    sample of ``version`` leaves out: a flip there is invisible to ``"sample"``."""
    for bucket in plan.buckets:
        slots = [(s.offset, s.nbytes) for s in bucket.slots]
        sampled = set(
            sample_positions(bucket.nbytes, sample_key(version, bucket.index), slots).tolist()
        )
        for slot in bucket.slots:
            size = torch.empty(0, dtype=getattr(torch, slot.dtype)).element_size()
            middle = slot.offset + slot.nbytes // 2 // size * size + size - 1
            for byte in range(middle, slot.offset + slot.nbytes - 1, size):
                if byte not in sampled:
                    return bucket, slot, byte
    raise AssertionError("every byte of the plan is sampled")


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _flip_for(
    verify: str, plan: BucketPlan, sent: dict[str, torch.Tensor]
) -> tuple[Bucket, int, int]:
    """The bucket, byte and bit mask of the flip each check must catch in sync 2:

    - ``"sample"``: a slot's first byte, always in the sample (the catch is deterministic);
    - ``"default"`` (the full check): one exponent bit the sample leaves out, a flip that
      makes the element ~1e37 or more (a weight the engine would serve);
    - ``"True"`` (the full check, asked for): any byte the sample leaves out.
    """
    if verify == "sample":
        bucket, slot = _second_slot(plan)
        return bucket, slot.offset, 0xFF
    if verify == "True":
        return (*_unsampled_byte(plan, version=2), 0xFF)
    bucket, slot, byte = _unsampled_exponent(plan, version=2)
    tensor = sent[slot.name].reshape(-1)
    element = (byte - slot.offset) // tensor.element_size()
    flipped = _raw(tensor.clone()).clone()
    flipped[byte - slot.offset] ^= 0x40
    assert abs(float(flipped.view(tensor.dtype)[element])) > 1e30
    return bucket, byte, 0x40


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
@pytest.mark.parametrize(("verify", "seed"), [("sample", 300), ("default", 305), ("True", 301)])
async def test_the_check_catches_a_byte_flipped_on_one_worker_and_the_next_sync_heals(
    verify_pool: WorkerPool, overlap: str, verify: str, seed: int
) -> None:
    """``verify="sample"`` catches a flip in its sample; the default check (``True``, every
    byte) catches one exponent bit, and any byte, that the sample would miss. The sync
    fails naming the worker, the bucket and its tensors; the next one lands."""
    trainer = _trainer(seed=seed)
    workers = await verify_pool.view([0, 1])
    options = {} if verify == "default" else {"verify": verify if verify == "sample" else True}
    mode = "'sample'" if verify == "sample" else "True"
    async with _sync(trainer, workers, overlap=overlap, **options) as sync:
        assert sync.verify == ("sample" if verify == "sample" else True)
        await sync.mark_stale()
        await sync.sync_weights()
        v1 = _checkpoint(trainer)
        _perturb(trainer, seed=seed)
        bucket, byte, mask = _flip_for(verify, sync.plan, _checkpoint(trainer))
        await _arm(verify_pool, FAULTY, bucket.index, byte, mask=mask)
        await sync.mark_stale()
        with pytest.raises(RefitVerificationError) as info:
            await sync.sync_weights()
        message = str(info.value)
        assert re.search(
            rf"engine worker {FAULTY}: bucket {bucket.index} \({re.escape(_names(bucket))}\) "
            rf"arrived with digest -?\d+, the trainer sent -?\d+ \(verify={re.escape(mode)}\)",
            message,
        ), message
        assert message.endswith(f"(verify={mode})"), message
        assert "engine worker 0:" not in message  # worker 0 received its buckets intact
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        if overlap == "inplace":
            # Every worker loaded into its live weights: none counts them valid.
            for i in (0, 1):
                with pytest.raises(TransportError, match="weights invalid"):
                    await verify_pool.call(i, "test_generate", prompts=PROMPTS, max_new_tokens=1)
        else:
            # Staged: the check failed before the commit, the live weights are version 1.
            await assert_bit_exact(verify_pool, [0, 1], v1)
            await verify_pool.call(FAULTY, "test_generate", prompts=PROMPTS, max_new_tokens=1)

        await sync.sync_weights()  # one-shot fault, none armed now: it lands
        assert (sync.weight_version, sync.is_stale) == (2, False)
    await assert_bit_exact(verify_pool, [0, 1], _checkpoint(trainer))


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
async def test_without_verify_the_flipped_byte_reaches_the_engines_weights(
    verify_pool: WorkerPool, overlap: str
) -> None:
    trainer = _trainer(seed=302)
    workers = await verify_pool.view([0, 1])
    async with _sync(trainer, workers, overlap=overlap, verify=False) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        _perturb(trainer, seed=3)
        bucket, slot = _second_slot(sync.plan)
        await _arm(verify_pool, FAULTY, bucket.index, slot.offset)
        await sync.mark_stale()
        await sync.sync_weights()  # nothing checks: it commits
        assert (sync.weight_version, sync.is_stale) == (2, False)
        expected = _checkpoint(trainer)
        await assert_bit_exact(verify_pool, [0], expected)
        got = (await verify_pool.call(FAULTY, "test_state_dict"))[slot.name]
        sent, held = _raw(expected[slot.name]), _raw(got)
        # Exactly the tensor's first byte differs, flipped; every other tensor is intact.
        assert torch.nonzero(sent != held).flatten().tolist() == [0]
        assert int(held[0]) == int(sent[0]) ^ 0xFF
        state = await verify_pool.call(FAULTY, "test_state_dict")
        assert all(torch.equal(state[n], t) for n, t in expected.items() if n != slot.name)


async def test_a_delta_sync_is_verified_and_a_failed_one_is_followed_by_a_full_one(
    verify_pool: WorkerPool,
) -> None:
    trainer = _trainer(seed=303)
    workers = await verify_pool.view([0, 1])
    async with _sync(trainer, workers, delta=True) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        # Three elements change: the delta's only bucket holds the sparse patch
        # ``model.norm.weight@where`` and ``@values``.
        with torch.no_grad():
            trainer.model.model.norm.weight[:3] += 1.0
        await _arm(verify_pool, FAULTY, 0, 0)
        await sync.mark_stale()
        with pytest.raises(
            RefitVerificationError,
            match=rf"engine worker {FAULTY}: bucket 0 \('model\.norm\.weight@where' and 1 more\)",
        ):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        async with sync.subscribe() as events:
            await sync.sync_weights()  # after a failure: a full sync
            with torch.no_grad():
                trainer.model.model.norm.weight[3:5] -= 1.0
            await sync.mark_stale()
            await sync.sync_weights()  # intact: the verified delta lands
            committed = [
                (e.version, e.delta)
                for e in [await events.__anext__() for _ in range(5)]
                if e.kind is VersionEventKind.COMMITTED
            ]
        assert committed == [(2, False), (3, True)]
    await assert_bit_exact(verify_pool, [0, 1], _checkpoint(trainer))


async def test_the_embedded_engine_refuses_to_generate_after_a_caught_fault() -> None:
    trainer = _trainer(seed=304)
    async with EmbeddedEngine(dict(QWEN3), num_workers=1, seed=7) as engine:
        sync = CollectiveWeightSynchronizer(
            DTensorRefitSource(trainer.model),
            engine,
            train_cluster=TrainCluster(master_port=_port()),
            inference_world_size=1,
            bucket_bytes=BUCKET_BYTES,
            collective_timeout_s=60.0,
        )
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()
            _perturb(trainer, seed=4)
            bucket, slot = _second_slot(sync.plan)
            await engine.collective_rpc(
                "aiosync_test_arm_transit_fault", (bucket.index, slot.offset)
            )
            await sync.mark_stale()
            with pytest.raises(
                RefitVerificationError, match=rf"engine worker 0: bucket {bucket.index} "
            ):
                await sync.sync_weights()
            assert (sync.weight_version, engine.weight_version, sync.is_stale) == (1, 1, True)
            await engine.prepare_for_generation()
            assert [s["weights_valid"] for s in await engine.status()] == [False]
            with pytest.raises(SyncError, match="not valid"):
                await engine.generate(PROMPTS, max_new_tokens=2)

            await sync.sync_weights()
            await engine.prepare_for_generation()
            assert (sync.weight_version, engine.weight_version) == (2, 2)
            [state] = await engine.hf_state_dicts()
            expected = _checkpoint(trainer)
            assert list(state) == list(expected)
            assert all(torch.equal(state[n], t) for n, t in expected.items())
            want = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
            assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == want
