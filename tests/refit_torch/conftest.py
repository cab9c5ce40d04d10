"""Fixtures for the torch refit seam: tiny HF models and their ``save_pretrained`` output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests._support.modules import load_module

HERE = Path(__file__).parent


# By path and under the name the spawned worker script imports (``_dist_worker.py`` puts
# this directory on its sys.path), so both build the same models.
_models = load_module(HERE / "_refit_torch_models.py")


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
