"""Pick a model map from an HF config's ``model_type``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._config import ConfigView
from .gemma4 import gemma4_map
from .qwen3 import qwen3_map
from .qwen3_moe import qwen3_moe_map
from .qwen3_next import qwen3_next_map
from .table import ModelMap

__all__ = ["SUPPORTED_MODEL_TYPES", "model_map_for"]

_BUILDERS: dict[str, Callable[[Any], ModelMap]] = {
    "qwen3": qwen3_map,
    "qwen3_moe": qwen3_moe_map,
    "qwen3_next": qwen3_next_map,
    "gemma4_text": gemma4_map,
    "gemma4": gemma4_map,
}

#: The HF ``model_type`` values :func:`model_map_for` accepts.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def model_map_for(config: Any) -> ModelMap:
    """The :class:`~aiosync.refit.nnx.table.ModelMap` for an HF config.

    Args:
        config: a transformers ``PretrainedConfig`` or a ``config.json`` dict
            (prefer the original file: transformers 5.24 renames some keys
            when it re-serialises).

    The map records ``config`` as its :attr:`~ModelMap.hf_config`.

    Raises:
        ValueError: ``model_type`` is missing or not one of
            :data:`SUPPORTED_MODEL_TYPES` (the message lists them).
    """
    model_type = ConfigView(config).get("model_type", default=None)
    builder = _BUILDERS.get(model_type) if isinstance(model_type, str) else None
    if builder is None:
        raise ValueError(
            f"no JAX refit map for model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    model_map = builder(config)
    # The config the shapes came from is also the trainer's side of the config check.
    model_map.hf_config = config
    return model_map
