"""Fixtures for the torch refit seam: tiny HF models and their ``save_pretrained`` output."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent


def _load_models_module() -> ModuleType:
    # By path: pytest's importlib mode does not put this directory on sys.path,
    # and the spawned worker script imports the same file, so both build the same models.
    name = "_refit_torch_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_models = _load_models_module()


@pytest.fixture(scope="session")
def build_model() -> Callable[..., torch.nn.Module]:
    """``build_model(kind, seed=0)``: a tiny fp32 HF model with random weights."""
    return _models.build_model  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def saved_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], dict[str, torch.Tensor]]:
    """``saved_checkpoint(kind)``: what ``save_pretrained`` writes for that model, read back."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(kind: str) -> dict[str, torch.Tensor]:
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{kind}")
            _models.build_model(kind).save_pretrained(path)
            cache[kind] = load_file(str(path / "model.safetensors"))
        return cache[kind]

    return get
