"""Fixtures for the JAX refit seam: tiny HF models and their checkpoint state dicts."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests._support.modules import load_module

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def models() -> ModuleType:
    """The tiny-config builders (``_refit_jax_models.py``)."""
    return load_module(HERE / "_refit_jax_models.py")


@pytest.fixture(scope="module")
def moe(models: ModuleType) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tiny Qwen3-MoE's config and its checkpoint state dict."""
    config = models.qwen3_moe_config()
    return config, models.checkpoint_state(models.build(config))


@pytest.fixture
def moe_params(moe: tuple[Any, dict[str, torch.Tensor]]) -> tuple[Any, Any]:
    """The tiny Qwen3-MoE's model map and its checkpoint as NNX params (fresh: a test
    may change them)."""
    from aiosync.refit.nnx import model_map_for

    config, state = moe
    model_map = model_map_for(config)
    return model_map, model_map.to_jax(state)


@pytest.fixture(scope="session")
def nnx_qwen3() -> ModuleType:
    """The NNX Qwen3 of ``examples/nnx_qwen3.py``; needs jax and flax."""
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    return load_module(HERE.parents[1] / "examples" / "nnx_qwen3.py")
