"""vLLM workers' expert-parallel layouts: the experts a worker reports are those
vLLM's own placement gives its EP rank (``determine_expert_map`` and the
``ExpertMapManager`` a ``FusedMoE`` layer builds), with the HF checkpoint names of
Qwen3-MoE, whole under EP, and match the planner's ``ep_layouts`` for linear
placement. Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from aiosync.engines.vllm._experts import ExpertPlacement, placed_experts
from aiosync.layout import Layout, Part, box_of
from aiosync.transports.sharded.estimate import ep_layouts

pytestmark = [pytest.mark.vllm]

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
