"""FP8 KV-cache scales as the engine's parameters, shared by every transport that sends them.

vLLM loads per-tensor FP8 KV-cache scales as ``model.layers.{i}.self_attn.{k,v}_scale``
(float32 scalars, remapped by its loaders' ``maybe_remap_kv_scale_name``); the
trainer gives them as ``{layer_index_or_name: float}`` (:data:`aiosync.KVScales`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from aiosync.errors import RefitMismatchError

__all__ = ["attention_layers", "kv_scale_entries"]

_KV_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.[kv]_scale")
_ATTN_PREFIX = re.compile(r"model\.layers\.(\d+)\.self_attn\.")


def attention_layers(names: Iterable[str]) -> frozenset[int]:
    """Layer indices ``i`` with a ``model.layers.{i}.self_attn.`` tensor among ``names``
    (HF checkpoint names of the refit manifest): the layers that have a KV cache."""
    return frozenset(
        int(m.group(1)) for m in (_ATTN_PREFIX.match(n) for n in names) if m is not None
    )


def kv_scale_entries(
    kv_scales: Mapping[str | int, float] | None,
    layers: frozenset[int] | None = None,
) -> list[tuple[str, float]]:
    """FP8 KV-cache scales → ``(engine parameter name, value)`` pairs, in key order.

    A layer index ``i`` gives both ``model.layers.{i}.self_attn.k_scale`` and
    ``...v_scale`` (one scale per layer, vLLM's per-tensor FP8 KV cache); a
    string key must be such a full name. The values travel as float32
    scalars and are loaded as 0-d float32 tensors.

    Args:
        layers: the attention layers of the refit manifest (:func:`attention_layers`);
            when given, every key must name one of them.

    Raises:
        ValueError: a string key that is not a KV-scale name, a negative layer
            index or one that is not in ``layers``, or a scale set twice.
        RefitMismatchError: a full name whose layer has no attention in ``layers``.
    """
    if not kv_scales:
        return []
    out: list[tuple[str, float]] = []
    known = "none" if not layers else ", ".join(str(i) for i in sorted(layers))
    for key, value in kv_scales.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if key < 0:
                raise ValueError(f"kv_scales layer index must be >= 0, got {key}")
            if layers is not None and key not in layers:
                raise ValueError(
                    f"kv_scales layer index {key} is not an attention layer of the "
                    f"refit manifest (layers with self_attn: {known})"
                )
            prefix = f"model.layers.{key}.self_attn."
            out += [(prefix + "k_scale", float(value)), (prefix + "v_scale", float(value))]
        elif isinstance(key, str) and (match := _KV_NAME.fullmatch(key)):
            if layers is not None and int(match.group(1)) not in layers:
                raise RefitMismatchError(
                    f"kv_scales key {key!r}: the refit manifest has no "
                    f"'model.layers.{match.group(1)}.self_attn.' tensors "
                    f"(layers with self_attn: {known})"
                )
            out.append((key, float(value)))
        else:
            raise ValueError(
                f"kv_scales key {key!r} is neither a layer index nor "
                "'model.layers.{i}.self_attn.{k|v}_scale'"
            )
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("kv_scales sets a scale twice (a layer index and its name)")
    return out
