"""FP8 KV-cache scales as the tensors vLLM's loader takes.

vLLM's attention layers hold ``k_scale`` / ``v_scale`` as 0-d float32
parameters, and its model loaders accept them under the checkpoint names
``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` (remapped inside vLLM by
``maybe_remap_kv_scale_name``). Only the collective transport sends them.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping

import torch

__all__ = ["kv_scale_name", "kv_scales_to_tensors"]

_NAME_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def kv_scale_name(layer: int, which: str) -> str:
    """``(3, "k")`` → ``"model.layers.3.self_attn.k_scale"`` (vLLM's checkpoint name)."""
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    return f"model.layers.{layer}.self_attn.{which}_scale"


def kv_scales_to_tensors(
    kv_scales: Mapping[str | int, float], num_layers: int | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Turn ``{layer_index_or_name: scale}`` into ``(name, tensor)`` pairs for ``load_weights``.

    Keys:
        an ``int`` layer index ``i`` sets both ``k_scale`` and ``v_scale`` of layer ``i``;
        a full name ``"model.layers.{i}.self_attn.{k|v}_scale"`` sets that one scale.

    Returns:
        pairs sorted by layer, ``k`` before ``v``; each tensor is float32, shape
        ``()`` (a 0-d tensor, as vLLM's ``k_scale`` parameters are), on CPU.

    Raises:
        ValueError: an unknown key, a layer outside ``[0, num_layers)``, a scale set
            twice (an index and a name for the same scale), or a scale that is not
            finite and > 0.
        TypeError: ``kv_scales`` is not a mapping, a key is neither ``int`` nor
            ``str`` (``bool`` included), or a value is not a real number.
    """
    if not isinstance(kv_scales, Mapping):
        raise TypeError(f"kv_scales must be a mapping, got {type(kv_scales).__name__}")
    if num_layers is not None and num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    values: dict[tuple[int, str], float] = {}
    for key, value in kv_scales.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"kv_scales[{key!r}] must be a float, got {type(value).__name__}")
        scale = float(value)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"kv_scales[{key!r}] must be finite and > 0, got {scale}")
        targets: list[tuple[int, str]]
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise TypeError(f"kv_scales key {key!r} must be a layer index or a name")
        if isinstance(key, int):
            if key < 0:
                raise ValueError(f"kv_scales layer index must be >= 0, got {key}")
            targets = [(key, "k"), (key, "v")]
        else:
            match = _NAME_RE.fullmatch(key)
            if match is None:
                raise ValueError(
                    f"kv_scales key {key!r} is neither a layer index nor "
                    "'model.layers.{i}.self_attn.{k|v}_scale'"
                )
            targets = [(int(match.group(1)), match.group(2))]
        for target in targets:
            if num_layers is not None and target[0] >= num_layers:
                raise ValueError(
                    f"kv_scales key {key!r}: layer {target[0]} is out of range "
                    f"for {num_layers} layers"
                )
            if target in values:
                raise ValueError(f"kv_scales sets {kv_scale_name(*target)} twice")
            values[target] = scale
    return [
        (kv_scale_name(layer, which), torch.tensor(values[layer, which], dtype=torch.float32))
        for layer, which in sorted(values)
    ]
