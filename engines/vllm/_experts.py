"""Which experts of a vLLM ``FusedMoE`` layer a worker holds, and what of each HF tensor.

Under expert parallelism (``--enable-expert-parallel``) vLLM gives each of the
``ep_size`` ranks of an MoE layer a set of whole experts (``tp_size`` 1 inside
the layer: ``FusedMoEParallelConfig.make``); without it every rank holds every
expert, cut like a dense MLP over the layer's ``tp_size`` ranks. Which global
experts an EP rank holds is vLLM's placement
(``model_executor/layers/fused_moe/expert_map_manager.py``,
``determine_expert_map``), restated here as :func:`placed_experts` and checked
against vLLM's own function in ``tests/vllm/test_vllm_experts.py``:

- ``linear``: ``E // ep`` consecutive experts per rank, the first ``E % ep`` ranks
  one more: rank ``r`` holds ``[r * (E // ep) + min(r, E % ep), ...)``.
- ``round_robin``: rank ``r`` holds ``r, r + ep, r + 2 * ep, ...``. vLLM honours it
  only for grouped routing (``num_expert_group > 1``) without EPLB, and falls back
  to ``linear`` otherwise (Qwen3-MoE): read the layer's effective strategy, not the
  requested one.

An expert ``e`` of the HF checkpoint is three tensors (Qwen3-MoE, Qwen3-Next,
Mixtral-style names): ``{prefix}.{e}.gate_proj.weight [Im, H]``,
``up_proj.weight [Im, H]`` and ``down_proj.weight [H, Im]``. vLLM packs a rank's
experts into ``w13_weight [local_E, 2 * Im / tp, H]`` (gate rows, then up rows)
and ``w2_weight [local_E, H, Im / tp]``, local slot ``i`` holding the ``i``-th
global expert of its placement. :class:`ExpertPlacement` gives the
:class:`~aiosync.layout.Part` of each held tensor; the experts of other ranks are
absent. See ``docs/vllm.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from aiosync.layout import Part

__all__ = ["ExpertPlacement", "PlacementStrategy", "placed_experts"]

#: vLLM's expert placement strategies (``ParallelConfig.expert_placement_strategy``).
PlacementStrategy = Literal["linear", "round_robin"]


def placed_experts(
    ep_size: int, ep_rank: int, num_experts: int, strategy: str = "linear"
) -> tuple[int, ...]:
    """Global ids of the experts EP rank ``ep_rank`` of ``ep_size`` holds, in the
    order of its local slots (vLLM's ``determine_expert_map``).

    Args:
        ep_size: ranks the layer's experts are spread over (``>= 1``; 1: no EP,
            every expert).
        ep_rank: this rank, ``0 <= ep_rank < ep_size``.
        num_experts: the layer's global (logical) experts, ``>= 0``.
        strategy: ``"linear"`` or ``"round_robin"`` (see the module docs).

    Raises:
        ValueError: a size or rank out of range, or another strategy.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size or num_experts < 0:
        raise ValueError(
            f"need ep_size >= 1, 0 <= ep_rank < ep_size and num_experts >= 0, got "
            f"ep_size={ep_size}, ep_rank={ep_rank}, num_experts={num_experts}"
        )
    if strategy not in get_args(PlacementStrategy):
        raise ValueError(
            f"expert placement strategy {strategy!r}: expected one of {get_args(PlacementStrategy)}"
        )
    if ep_size == 1:
        return tuple(range(num_experts))
    if strategy == "round_robin":
        return tuple(range(ep_rank, num_experts, ep_size))
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return tuple(range(start, start + base + (1 if ep_rank < extra else 0)))


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """What one worker holds of one MoE layer's experts.

    Attributes:
        prefix: the HF name of the layer's experts, without the expert index
            (``model.layers.3.mlp.experts``).
        experts: global ids of the experts held, in local slot order
            (:func:`placed_experts`, or read off a live layer's expert map).
        hidden_size: H, the experts' input and output width.
        intermediate_size: Im, the full (checkpoint) width of each expert's
            ``gate_proj``/``up_proj`` output and ``down_proj`` input.
        tp_size: ranks each held expert is cut over (1 under EP in vLLM).
        tp_rank: this worker's rank among them.
        names: the checkpoint names of the gate, down and up projections
            (vLLM's ``ckpt_names``).

    Raises:
        ValueError: a rank out of range, a repeated expert, or Im not divisible by
            ``tp_size``.
    """

    prefix: str
    experts: tuple[int, ...]
    hidden_size: int
    intermediate_size: int
    tp_size: int = 1
    tp_rank: int = 0
    names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} of tp_size {self.tp_size}")
        if len(set(self.experts)) != len(self.experts) or min(self.experts, default=0) < 0:
            raise ValueError(f"{self.prefix}: experts {self.experts} repeat or are negative")
        if self.intermediate_size % self.tp_size:
            raise ValueError(
                f"{self.prefix}: intermediate size {self.intermediate_size} does not split "
                f"over {self.tp_size} ranks"
            )

    @property
    def local_intermediate(self) -> int:
        """``Im / tp_size``: each held expert's rows of gate and up (columns of down)."""
        return self.intermediate_size // self.tp_size

    def tensors(self) -> list[tuple[str, int, str, Part]]:
        """``(hf_name, local slot, shard, part)`` of every tensor held, slot by slot,
        gate, up, then down: ``shard`` is vLLM's ``w1`` (gate: rows ``[0, n)`` of
        ``w13_weight[slot]``), ``w3`` (up: rows ``[n, 2n)``) or ``w2`` (down: all of
        ``w2_weight[slot]``), ``n`` = :attr:`local_intermediate`. Gate and up are cut
        along dim 0 of ``[Im, H]``, down along dim 1 of ``[H, Im]``."""
        gate, down, up = self.names
        h, im, n = self.hidden_size, self.intermediate_size, self.local_intermediate
        start = self.tp_rank * n
        held: list[tuple[str, int, str, Part]] = []
        for slot, e in enumerate(self.experts):
            base = f"{self.prefix}.{e}"
            held.append((f"{base}.{gate}.weight", slot, "w1", _part((im, h), 0, start, n)))
            held.append((f"{base}.{up}.weight", slot, "w3", _part((im, h), 0, start, n)))
            held.append((f"{base}.{down}.weight", slot, "w2", _part((h, im), 1, start, n)))
        return held

    def layout(self) -> dict[str, Part]:
        """``{hf_name: part}`` of every expert tensor this worker holds (an
        :data:`aiosync.layout.Layout`; the experts of other ranks are absent)."""
        return {name: part for name, _, _, part in self.tensors()}


def _part(shape: Sequence[int], dim: int, start: int, length: int) -> Part:
    part = Part(tuple(shape), dim, start, length)
    return Part.whole(part.shape) if part.is_whole else part
