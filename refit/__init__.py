"""Refit sources: a trainer's weights as the engine's HF checkpoint, streamed.

``refit`` imports torch (this is the torch seam) but never jax; the JAX/NNX
sources live in their own modules. Nothing here imports ``transports``.
"""

from __future__ import annotations

from .kv_scales import kv_scales_to_tensors
from .torch_source import DTensorRefitSource

__all__ = [
    "DTensorRefitSource",
    "kv_scales_to_tensors",
]
