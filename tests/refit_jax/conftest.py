"""Fixtures for the JAX refit seam: tiny HF models and their checkpoint state dicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent


def load_local(name: str, folder: Path = HERE) -> ModuleType:
    """Import ``folder/name.py`` by path (pytest's importlib mode keeps it off sys.path)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def models() -> ModuleType:
    """The tiny-config builders (``_refit_jax_models.py``)."""
    return load_local("_refit_jax_models")


@pytest.fixture(scope="session")
def nnx_qwen3() -> ModuleType:
    """The NNX Qwen3 of ``examples/nnx_qwen3.py``; needs jax and flax."""
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    return load_local("nnx_qwen3", HERE.parents[1] / "examples")
