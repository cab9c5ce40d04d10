"""Where each checkpoint name lives in a transformers model: the checkpoint manifest,
the in-memory tensor (or the slice of a fused one) each name resolves to, and the
overlap of a name's box with a tensor-parallel part (``model.py`` explains the layouts)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from aiosync.errors import RefitMismatchError
from aiosync.layout import Part

if TYPE_CHECKING:
    pass


# Checkpoint name of one expert's projection; the fused in-memory tensors live on
# the ``experts`` module (transformers 5.x, ``conversion_mapping.py`` "qwen2_moe").
_EXPERT_NAME = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)


def _checkpoint_manifest(model: PreTrainedModel) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What ``save_pretrained`` would write, computed on ``meta`` copies (no data moves)."""
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    meta = {name: tensor.to("meta") for name, tensor in state.items()}
    reverted = revert_weight_conversion(model, meta)
    return {name: (tuple(t.shape), t.dtype) for name, t in reverted.items()}


def _narrow(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """``part``'s slice of the full tensor ``tensor`` (a view)."""
    return tensor.narrow(part.dim, part.start, part.length)


def _overlap(
    a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...] | None:
    """The intersection of two boxes (``(start, stop)`` per dim); None if empty."""
    box = tuple(
        (max(lo_a, lo_b), min(hi_a, hi_b)) for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b, strict=True)
    )
    return None if any(lo >= hi for lo, hi in box) else box


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and buffers by name (the objects, ties under every name)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def _homes(tensors: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """Where each of ``tensors`` lives (its data pointer), in order."""
    return tuple(t.data_ptr() for t in tensors.values())


def _resolve_targets(
    model: PreTrainedModel,
    named: Mapping[str, torch.Tensor],
    manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    layout: Mapping[str, Part],
) -> dict[str, torch.Tensor]:
    """``{checkpoint name: view of the in-memory tensor it is loaded into}`` for every
    name ``layout`` holds (manifest order), each of the shape of the part held
    (``layout[name].local_shape``); ``named``: the model's tensors by name
    (:func:`_named_tensors`). An expert-parallel rank's fused experts hold a
    contiguous range of experts: its first held expert is index 0 in memory."""
    tensors = {name: t.detach() for name, t in named.items()}
    first_expert: dict[str, int] = {}
    for name in layout:
        match = _EXPERT_NAME.match(name)
        if match is not None:
            e = int(match["e"])
            first_expert[match["experts"]] = min(e, first_expert.get(match["experts"], e))
    targets: dict[str, torch.Tensor] = {}
    for name, (_, dtype) in manifest.items():
        if name not in layout:
            continue  # another expert-parallel rank's expert
        shape = layout[name].local_shape
        view = tensors.get(name)
        if view is None:
            view = _expert_view(tensors, name, first_expert)
        if view is None or tuple(view.shape) != shape or view.dtype != dtype:
            found = None if view is None else (tuple(view.shape), view.dtype)
            raise RefitMismatchError(
                f"checkpoint tensor {name!r} {shape} {dtype} has no place in "
                f"{type(model).__name__} (found {found})"
            )
        targets[name] = view
    return targets


def _expert_view(
    tensors: Mapping[str, torch.Tensor], name: str, first_expert: Mapping[str, int]
) -> torch.Tensor | None:
    """The slice of a fused expert tensor that a per-expert checkpoint name maps to.

    ``gate_up_proj [E, 2*Im, H]`` holds the gate in rows ``[:Im]`` and up in
    ``[Im:]``; ``down_proj [E, H, Im]`` holds expert ``e`` at index
    ``e - first_expert[experts module]`` (0 unless only some experts are held).
    """
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    experts, proj = match["experts"], match["proj"]
    e = int(match["e"]) - first_expert.get(experts, 0)
    if proj == "down":
        fused = tensors.get(f"{experts}.down_proj")
        return None if fused is None or not 0 <= e < fused.shape[0] else fused[e]
    fused = tensors.get(f"{experts}.gate_up_proj")
    if fused is None or not 0 <= e < fused.shape[0]:
        return None
    im = fused.shape[1] // 2
    return fused[e, :im] if proj == "gate" else fused[e, im:]
