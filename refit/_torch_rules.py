"""Zero-copy splits of fused in-memory tensors into checkpoint tensors, as data.

transformers' own reversal (``revert_weight_conversion``) decides the names and
shapes; it also makes a contiguous copy of a whole fused expert tensor
(``Chunk`` → ``.contiguous()``), which for Qwen3-30B-A3B is 1.6 GB per layer in
fp32. Where a rule below gives exactly the same names and shapes (checked on
meta tensors when the plan is built), the source yields views of the fused
tensor instead, one expert at a time, so only one output tensor (its cast) is
ever extra.

Layouts (transformers 5.x ``conversion_mapping.py`` "qwen2_moe", used by
Qwen3-MoE and Qwen3-Next; checkpoints and vLLM's loaders use per-expert names):

* ``{p}.experts.gate_up_proj [E, 2*Im, H]`` → for each part (gate rows
  ``[:Im]``, then up rows ``[Im:]``), for each expert ``e``:
  ``{p}.experts.{e}.gate_proj.weight [Im, H]``, then ``...up_proj.weight``;
* ``{p}.experts.down_proj [E, H, Im]`` → ``{p}.experts.{e}.down_proj.weight [H, Im]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class _ExpertSplit:
    """``[E, P*X, ...]`` → part ``j`` of expert ``e`` is ``t[e, j*X:(j+1)*X]``, named
    ``templates[j].format(prefix=..., e=e)``; parts outer, experts inner."""

    pattern: re.Pattern[str]
    templates: tuple[str, ...]

    def split(
        self, key: str, tensor: torch.Tensor, first_expert: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        match = self.pattern.fullmatch(key)
        parts = len(self.templates)
        if match is None or tensor.dim() < 2 or tensor.shape[1] % parts:
            return None
        return self._views(match.group("prefix"), tensor, first_expert)

    def _views(
        self, prefix: str, tensor: torch.Tensor, first_expert: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        rows = tensor.shape[1] // len(self.templates)
        for j, template in enumerate(self.templates):
            for e in range(tensor.shape[0]):
                name = template.format(prefix=prefix, e=first_expert + e)
                yield name, tensor[e, j * rows : (j + 1) * rows]


_RULES: tuple[_ExpertSplit, ...] = (
    _ExpertSplit(
        re.compile(r"(?P<prefix>.+\.experts)\.gate_up_proj"),
        ("{prefix}.{e}.gate_proj.weight", "{prefix}.{e}.up_proj.weight"),
    ),
    _ExpertSplit(
        re.compile(r"(?P<prefix>.+\.experts)\.down_proj"),
        ("{prefix}.{e}.down_proj.weight",),
    ),
)


def _zero_copy_split(
    key: str, tensor: torch.Tensor, first_expert: int = 0
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Lazy ``(checkpoint_name, view)`` pairs for a fused tensor a rule knows, else None.

    ``tensor`` may be a run of whole experts cut along dim 0 (an FSDP2 rank's
    chunk of ``[E, ...]``): its row ``i`` is expert ``first_expert + i``, and
    the names say so (the shard-aware transport sends each rank's experts).
    """
    for rule in _RULES:
        views = rule.split(key, tensor, first_expert)
        if views is not None:
            return views
    return None
