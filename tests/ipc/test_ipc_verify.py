"""``verify=``: every IPC bucket is digested on both sides; a byte flipped on the receive path
fails the sync (typed, version kept, engine refusing) and the next sync heals bit-exact.

The fault is the workers' test hook ``aiosync_test_arm_transit_fault(bucket, byte)``: the
worker flips that byte of the shared buffer right after mapping it, before its copy into
the weights and before its check, so with ``verify=False`` the corruption really lands.
One engine worker (``dense_engine``): two workers would flip the one shared buffer twice.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import RefitVerificationError, SyncError
from aiosync.transports._verify import sample_key, sample_positions
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.packing import Bucket, TensorSlot

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: 64 KiB buckets of the tiny tied Qwen3: 8 buckets of 2-4 tensors each.
BUCKET_BYTES = 65536
#: Bucket 4 holds both layer-0 norms, then layer 1's q_proj and k_proj.
BUCKET = 4
#: The faulted tensor: the bucket's third (its first byte is not the bucket's).
SLOT = 2


async def _synchronizer(
    engine: EmbeddedEngine, h: SimpleNamespace, seed: int, **options: Any
) -> IPCWeightSynchronizer:
    """An initialised synchronizer over a trainer of ``seed`` (``sync.trainer``)."""
    trainer = h.trainer_model(h.DENSE_TIED, seed=seed)
    sync = IPCWeightSynchronizer(
        h.TrainerSource(trainer.model, []),
        engine,
        bucket_bytes=BUCKET_BYTES,
        rpc_timeout_s=30,
        **options,
    )
    sync.trainer = trainer  # type: ignore[attr-defined]
    await sync.init_communicator()
    return sync


def _target(sync: IPCWeightSynchronizer) -> tuple[Bucket, TensorSlot]:
    assert sync.plan is not None
    bucket = sync.plan.buckets[BUCKET]
    assert [s.name for s in bucket.slots] == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ]
    return bucket, bucket.slots[SLOT]


async def _arm(engine: EmbeddedEngine, bucket: int, byte: int, mask: int = 0xFF) -> None:
    await engine.collective_rpc("aiosync_test_arm_transit_fault", (bucket, byte, mask))


async def _fails_caught_then_heals(
    sync: IPCWeightSynchronizer,
    engine: EmbeddedEngine,
    h: SimpleNamespace,
    mode: str,
    fault: tuple[Any, ...],
) -> None:
    """With ``fault`` (:func:`_arm`'s bucket, byte and mask) armed, the next sync raises
    RefitVerificationError naming the worker, the bucket and its first tensor; nothing
    commits, the engine refuses; the sync after it lands."""
    await _arm(engine, *fault)
    version = sync.weight_version
    await sync.mark_stale()
    with pytest.raises(RefitVerificationError) as info:
        await sync.sync_weights()
    assert re.fullmatch(
        rf"engine worker 0( \(aiosync_ipc_receive\))?: bucket {BUCKET} "
        r"\('model\.layers\.0\.input_layernorm\.weight' and 3 more\) "
        rf"arrived with digest -?\d+, the trainer sent -?\d+ \(verify={mode}\)",
        str(info.value),
    )
    assert (sync.weight_version, sync.is_stale) == (version, True)
    await engine.prepare_for_generation()
    assert [s["weights_valid"] for s in await engine.status()] == [False]
    with pytest.raises(SyncError, match="worker 0: weights are not valid"):
        await engine.generate(h.PROMPTS, max_new_tokens=2)
    await sync.sync_weights()  # the fault was one-shot
    assert (sync.weight_version, sync.is_stale) == (version + 1, False)
    await h.assert_engine_equals(engine, sync.trainer)  # type: ignore[attr-defined]
    assert [s["weights_valid"] for s in await engine.status()] == [True]


async def test_sample_catches_a_flipped_first_byte_of_a_tensor_and_heals(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with await _synchronizer(dense_engine, h, seed=41, verify="sample") as sync:
        bucket, slot = _target(sync)
        # A slot's first byte is always in the sample: the catch is certain.
        fault = (bucket.index, slot.offset)
        await _fails_caught_then_heals(sync, dense_engine, h, "'sample'", fault=fault)


async def test_the_default_check_catches_one_flipped_exponent_bit_the_sample_misses(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with await _synchronizer(dense_engine, h, seed=46) as sync:  # the default verify
        assert sync.verify is True
        bucket, slot = _target(sync)
        size = torch.empty(0, dtype=getattr(torch, slot.dtype)).element_size()
        element = slot.nbytes // size // 2 + 1
        # The last byte of a middle element (little-endian): bit 6 is its exponent's top.
        byte = slot.offset + element * size + size - 1
        sampled = sample_positions(
            bucket.nbytes, sample_key(1, bucket.index), [(s.offset, s.nbytes) for s in bucket.slots]
        )
        assert byte not in set(sampled.tolist())  # "sample" would let it through
        sent = sync.trainer.hf_state_dict()[slot.name].reshape(-1)  # type: ignore[attr-defined]
        flipped = sent.clone()
        flipped.view(torch.uint8)[element * size + size - 1] ^= 0x40
        assert abs(float(flipped[element])) > 1e30  # a weight the engine would serve
        fault = (bucket.index, byte, 0x40)  # mask: bit 6 of the byte
        await _fails_caught_then_heals(sync, dense_engine, h, "True", fault=fault)


async def test_full_verify_catches_a_flipped_byte_in_the_middle_of_a_tensor(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with await _synchronizer(dense_engine, h, seed=42, verify=True) as sync:
        bucket, slot = _target(sync)
        byte = slot.offset + slot.nbytes // 2 + 3
        assert slot.offset < byte < slot.offset + slot.nbytes - 1  # not a slot end
        await _fails_caught_then_heals(sync, dense_engine, h, "True", fault=(bucket.index, byte))


async def test_without_verify_the_flipped_byte_lands_in_the_engine_weights(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # What the check exists for: unchecked, the sync commits a corrupted tensor.
    async with await _synchronizer(dense_engine, h, seed=43, verify=False) as sync:
        bucket, slot = _target(sync)
        within = 5
        await _arm(dense_engine, bucket.index, slot.offset + within)
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        expected = sync.trainer.hf_state_dict()  # type: ignore[attr-defined]
        [live] = await dense_engine.hf_state_dicts()
        sent = expected[slot.name].contiguous().reshape(-1).view(torch.uint8)
        got = live[slot.name].contiguous().reshape(-1).view(torch.uint8)
        differs = (sent != got).nonzero().flatten().tolist()
        assert differs == [within]
        assert int(got[within]) == int(sent[within]) ^ 0xFF
        # Every other tensor landed intact.
        for name, tensor in expected.items():
            if name != slot.name:
                assert torch.equal(live[name], tensor), name


async def test_a_delta_sync_verifies_its_patch_buckets_and_the_next_sync_heals(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with await _synchronizer(dense_engine, h, seed=44, delta=True) as sync:
        await sync.mark_stale()
        await sync.sync_weights()  # full: the baseline
        params = dict(sync.trainer.model.named_parameters())  # type: ignore[attr-defined]
        with torch.no_grad():
            params["model.norm.weight"][:4] += 1.0
        # The patches' wire plan: one patch, so its bucket 0 starts with it.
        await _arm(dense_engine, 0, 0)
        await sync.mark_stale()
        with pytest.raises(RefitVerificationError) as info:
            await sync.sync_weights()
        # Bucket 0 of the full plan starts with the embedding: this is the patch's.
        assert re.fullmatch(
            r"engine worker 0( \(aiosync_ipc_receive\))?: bucket 0 \('model\.norm\.weight.*\) "
            r"arrived with digest -?\d+, the trainer sent -?\d+ \(verify=True\)",
            str(info.value),
        )
        assert (sync.weight_version, sync.is_stale) == (1, True)
        assert [s["weights_valid"] for s in await dense_engine.status()] == [False]
        await sync.sync_weights()  # full again: the failed delta dropped the baseline
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert [r["delta"] for r in sync.last_worker_results] == [False]
        await h.assert_engine_equals(dense_engine, sync.trainer)  # type: ignore[attr-defined]
