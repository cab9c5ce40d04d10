"""Fixtures for PEFT (LoRA) trainers: tiny PEFT-wrapped Qwen3 models."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from peft import PeftModel
from transformers import Qwen3ForCausalLM

HERE = Path(__file__).parent


def _load_models_module() -> ModuleType:
    # By path: pytest's importlib mode does not put this directory on sys.path,
    # and the spawned worker script imports the same file, so both build the same models.
    name = "_peft_models"
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
def build_peft() -> Callable[..., PeftModel]:
    """``build_peft(seed=0, *, config=None, extra_adapters=None, active=None, dtype=None,
    **lora)``: a tiny PEFT-wrapped Qwen3 with random, nonzero adapters."""
    return _models.build_peft  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def build_base() -> Callable[..., Qwen3ForCausalLM]:
    """``build_base(seed=0, **config)``: the same tiny Qwen3 without PEFT."""
    return _models.build_base  # type: ignore[no-any-return]
