"""The JAX (flax NNX) refit seam: NNX params ↔ the HF state dict, through exact inverses.

One declarative table per model family (:mod:`.qwen3`, :mod:`.qwen3_moe`,
:mod:`.qwen3_next`, :mod:`.gemma4`) gives both the loader
(:meth:`ModelMap.to_jax`) and its exact inverse (:meth:`ModelMap.to_hf`);
:class:`NNXRefitSource` streams the inverse to a transport.
:func:`model_map_for` picks the table from an HF config. jax, flax and
ml_dtypes are the ``aiosync[jax]`` extra.
"""

from __future__ import annotations

from .registry import SUPPORTED_MODEL_TYPES, model_map_for
from .source import NNXRefitSource
from .table import ModelMap, NNXPath, Rule

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelMap",
    "NNXPath",
    "NNXRefitSource",
    "Rule",
    "model_map_for",
]
