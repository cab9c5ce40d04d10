"""The embedded engine's construction arguments: their checks (quantization, draft,
dtype) and the model spec the workers build from (a config dict or a folder)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _check_quantization(
    quantization: object, tensor_parallel_size: int, runner_factory: str | None
) -> None:
    """Raise ValueError unless ``quantization`` is None, or ``"fp8"`` on a plain engine."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    if quantization is None:
        return
    if tensor_parallel_size > 1:
        raise ValueError(
            "quantization='fp8' does not work with tensor_parallel_size > 1 (a Megatron "
            "slice would cut the 128x128 scaling blocks); use tensor_parallel_size=1"
        )
    if runner_factory is not None:
        raise ValueError("quantization='fp8' does not work with a runner_factory")


def _check_draft(
    prefix: object, tensor_parallel_size: int, runner_factory: str | None, quantization: object
) -> None:
    """Raise ValueError unless a draft model can be held by this engine's workers."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"draft_prefix must be a non-empty string, got {prefix!r}")
    if tensor_parallel_size > 1 or runner_factory is not None or quantization is not None:
        raise ValueError(
            "a draft model works with none of tensor_parallel_size > 1, runner_factory "
            "and quantization in the embedded engine"
        )


def _check_dtype(dtype: object) -> None:
    """Raise TypeError/ValueError unless ``dtype`` names a torch floating dtype."""
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a dtype name (str), got {type(dtype).__name__}")
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype must name a torch floating dtype (e.g. 'float32', 'bfloat16'), got {dtype!r}"
        )


def _model_spec(model: object) -> dict[str, Any] | str:
    """What the workers build the model from: a config dict, or a path as a string.

    A transformers ``PretrainedConfig`` is taken by its ``to_dict()`` (which
    carries ``model_type``); duck-typed so that this module does not import
    transformers in the trainer process.
    """
    if isinstance(model, Mapping):
        return dict(model)
    if isinstance(model, str | os.PathLike):
        return os.fspath(model)
    to_dict = getattr(model, "to_dict", None)
    spec = to_dict() if callable(to_dict) else None
    if isinstance(spec, Mapping) and spec.get("model_type"):
        return dict(spec)
    raise TypeError(
        "model must be an HF config (a transformers PretrainedConfig or its dict with "
        f"'model_type'), a config.json path or a model folder, got {type(model).__name__}"
    )


def _build_config(spec: dict[str, Any] | str) -> PretrainedConfig:
    """The config :meth:`HFModelRunner.from_config` builds from ``spec`` (worker thread)."""
    from transformers import AutoConfig

    # The runner's module imports transformers: only here, in the worker thread.
    from .model import resolve_hf_config

    resolved = resolve_hf_config(spec)
    if isinstance(resolved, Path):
        config: PretrainedConfig = AutoConfig.from_pretrained(resolved)
        return config
    return resolved
