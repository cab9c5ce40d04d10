"""Verified adapter-only refits (``verify=``): a byte of an adapter tensor flipped in transit.

The fault is the engine workers' own test hook (``aiosync_test_arm_transit_fault``;
for an adapter, "bucket" ``i`` is tensor ``i`` of the adapter): it flips one byte
of a tensor the worker decoded, before the worker checks and loads it. With a
check the sync fails with :class:`~aiosync.RefitVerificationError` naming the
worker, the adapter and the tensor, and the engine refuses to generate until a
sync lands; without one the corruption is what the engine applies.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from lora_harness import NEW_TOKENS, PROMPTS, LoRATrainer, lora_engine

from aiosync import LoRAAdapter, LoRAAdapterSynchronizer, RefitVerificationError, SyncError
from aiosync.engines.embedded._worker import tensor_from_wire
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.transports._verify import (
    SAMPLE_BYTES,
    arm_transit_fault,
    sample_key,
    sample_positions,
)
from aiosync.transports.lora import adapter_digests, check_saved_adapter
from tests._support.steps import resync

#: The async tests share the module's engine, so its event loop.
on_module_loop = pytest.mark.asyncio(loop_scope="module")

#: The adapter tensor the fault is armed on (a lora_B: random, nonzero).
TENSOR = 5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with lora_engine(1) as engine:
        yield engine


def _adapter(trainer: LoRATrainer) -> dict[str, torch.Tensor]:
    """The trainer's adapter tensors as the source yields them, in order."""
    return {name: t.detach().clone() for name, t in trainer.source.iter_weights()}


@contextlib.asynccontextmanager
async def _synced(
    trainer: LoRATrainer, engine: EmbeddedEngine, verify: Any
) -> AsyncIterator[LoRAAdapterSynchronizer]:
    """A LoRA synchronizer (``verify``) of ``trainer``'s adapter, after its first sync."""
    async with LoRAAdapterSynchronizer(trainer.source, engine, verify=verify) as sync:
        await resync(sync)
        yield sync


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


async def _live_adapter(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    """The tensors the engine's worker applies, PEFT's saved names."""
    [state] = await engine.collective_rpc("embedded_lora_state_dict")
    return {name: tensor_from_wire(fields) for name, fields in state.items()}


async def _arm(engine: EmbeddedEngine, tensor: int, byte: int) -> None:
    await engine.collective_rpc("aiosync_test_arm_transit_fault", (tensor, byte))


def _caught(name: str, version: int, mode: str, tensor: int = TENSOR) -> str:
    """The error's text (a regex) for tensor ``tensor`` named ``name``."""
    return (
        rf"engine worker 0 \(embedded_load_lora_adapter\): LoRA adapter 'aiosync-v{version}': "
        rf"tensor {tensor} \({re.escape(repr(name))}\) arrived with digest -?\d+, "
        rf"the trainer sent -?\d+ \(verify={re.escape(mode)}\)"
    )


@on_module_loop
async def test_sample_verify_by_default_catches_a_flipped_first_byte_and_the_next_sync_heals(
    engine: EmbeddedEngine, trainer: LoRATrainer
) -> None:
    async with LoRAAdapterSynchronizer(trainer.source, engine) as sync:
        assert sync.verify == "sample"
        await resync(sync)
        trainer.step(seed=21)
        name = list(_adapter(trainer))[TENSOR]
        # A tensor's first byte is always in the sample: the catch is deterministic.
        await _arm(engine, TENSOR, 0)
        await sync.mark_stale()
        with pytest.raises(RefitVerificationError, match=_caught(name, 2, "'sample'")):
            await sync.sync_weights()
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        # Neither the corrupt adapter nor, silently, version 1's.
        with pytest.raises(SyncError, match="did not complete"):
            await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert [(s["lora_adapter"], s["lora_loaded"]) for s in await engine.status()] == [
            (None, [])
        ]

        await sync.sync_weights()  # no fault armed: it lands
        assert (sync.weight_version, sync.is_stale) == (2, False)
        live, sent = await _live_adapter(engine), _adapter(trainer)
        assert list(live) == list(sent)
        assert all(torch.equal(live[n], t) for n, t in sent.items())
        assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )


@on_module_loop
async def test_full_verify_catches_a_flipped_middle_byte(
    engine: EmbeddedEngine, trainer: LoRATrainer
) -> None:
    async with _synced(trainer, engine, verify=True) as sync:
        trainer.step(seed=22)
        # A byte in the middle of the tensor. (The sample, too, covers every byte of
        # a tensor of at most SAMPLE_BYTES bytes, as these are; tests/packing and
        # tests/collective flip a byte that it leaves out of larger ones.)
        name, tensor = list(_adapter(trainer).items())[TENSOR]
        nbytes = tensor.numel() * tensor.element_size()
        assert nbytes <= SAMPLE_BYTES
        assert nbytes // 2 in sample_positions(nbytes, sample_key(2, TENSOR), [(0, nbytes)])
        index = TENSOR
        await _arm(engine, index, nbytes // 2)
        await sync.mark_stale()
        with pytest.raises(RefitVerificationError, match=_caught(name, 2, "True", index)):
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, True)
        await sync.sync_weights()
        assert sync.weight_version == 2
        live = await _live_adapter(engine)
        assert all(torch.equal(live[n], t) for n, t in _adapter(trainer).items())


@on_module_loop
async def test_without_verify_the_flipped_byte_is_what_the_engine_applies(
    engine: EmbeddedEngine, trainer: LoRATrainer
) -> None:
    async with _synced(trainer, engine, verify=False) as sync:
        trainer.step(seed=23)
        await _arm(engine, TENSOR, 0)
        await sync.mark_stale()
        await sync.sync_weights()  # nothing checks: it commits
        assert (sync.weight_version, sync.is_stale) == (2, False)
        live, sent = await _live_adapter(engine), _adapter(trainer)
        name = list(sent)[TENSOR]
        held, want = _raw(live[name]), _raw(sent[name])
        # Exactly the tensor's first byte differs, flipped; every other tensor is intact.
        assert torch.nonzero(held != want).flatten().tolist() == [0]
        assert int(held[0]) == int(want[0]) ^ 0xFF
        assert all(torch.equal(live[n], t) for n, t in sent.items() if n != name)


def test_a_folder_handed_to_an_engine_is_read_back_and_checked(
    tmp_path: Path, trainer: LoRATrainer
) -> None:
    # What the vLLM and SGLang backends do before the engine reads the folder.
    tensors = _adapter(trainer)
    name = list(tensors)[TENSOR]
    adapter = LoRAAdapter(
        "aiosync-v3", 3, tensors, {"r": 4}, "sample", adapter_digests(tensors, "sample", 3)
    )
    folder = adapter.save(tmp_path / "adapter")
    check_saved_adapter(folder, adapter)  # intact: passes
    arm_transit_fault(TENSOR, 0)  # this process reads the folder back
    with pytest.raises(
        RefitVerificationError,
        match=rf"LoRA adapter 'aiosync-v3': tensor {TENSOR} \({re.escape(repr(name))}\) "
        rf"read back from {re.escape(str(folder))} with digest -?\d+, the trainer sent",
    ):
        check_saved_adapter(folder, adapter)
    unchecked = LoRAAdapter("aiosync-v3", 3, tensors, {"r": 4})
    assert (unchecked.verify, dict(unchecked.digests)) == (False, {})
    check_saved_adapter(folder, unchecked)  # nothing to check: nothing is read


@pytest.mark.parametrize("verify", ["full", "Sample", 1, 0, None])
def test_a_bad_verify_is_refused_at_construction(verify: object, trainer: LoRATrainer) -> None:
    with pytest.raises(ValueError, match="verify must be True, False or 'sample'"):
        LoRAAdapterSynchronizer(trainer.source, object(), verify=verify)  # type: ignore[arg-type]
