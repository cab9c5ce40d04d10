"""Refit sources: a trainer's weights as the engine's HF checkpoint, streamed.

``aiosync.refit`` imports torch (this is the torch seam) but never jax; the JAX/NNX
sources live in their own modules. Nothing here imports ``aiosync.transports``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fp8 import FP8RefitSource
from .kv_scales import kv_scales_to_tensors
from .lora_source import LoRAAdapterRefitSource
from .shared import SharedParameters, share_parameters
from .torch_source import DTensorRefitSource

__all__ = [
    "DTensorRefitSource",
    "FP8RefitSource",
    "LoRAAdapterRefitSource",
    "NNXRefitSource",
    "SharedParameters",
    "kv_scales_to_tensors",
    "model_map_for",
    "share_parameters",
]

if TYPE_CHECKING:
    from .nnx import NNXRefitSource, model_map_for

# The JAX seam (refit/nnx/), loaded on first use so importing aiosync.refit never imports jax.
_NNX_EXPORTS = frozenset({"NNXRefitSource", "model_map_for"})


def __getattr__(name: str) -> object:
    if name in _NNX_EXPORTS:
        from . import nnx

        return getattr(nnx, name)
    raise AttributeError(f"module 'aiosync.refit' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that dir() and tab completion show the JAX seam.
    return sorted({*globals(), *__all__})
