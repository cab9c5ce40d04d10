"""PEFT models sharded with FSDP2 on a real 2-rank gloo group stream what the unsharded model does.

One spawn of two real processes (``_peft_dist_worker.py``) runs every case of
``_peft_models.FSDP2_CASES`` and saves what each rank streamed (the refit_torch
worker's format); the tests compare it, name for name and bit for bit, with the
same model unsharded: ``merge_and_unload()`` for the merged refit,
``get_peft_model_state_dict`` for the adapter.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict

from aiosync.refit import DTensorRefitSource
from tests._support.checks import assert_stream_matches

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
REPO = HERE.parent.parent
WORLD_SIZE = 2
CASES = sys.modules["_peft_models"].FSDP2_CASES


def _refit_torch_harness() -> ModuleType:
    """The refit_torch distributed test module: its free-port picker and output reader."""
    name = "_refit_torch_test_distributed"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "tests" / "refit_torch" / "test_distributed.py"
        )
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_harness = _refit_torch_harness()


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> Path:
    """Run both ranks once; the directory of their outputs."""
    out = tmp_path_factory.mktemp("peft_dist")
    spawn_ranks(HERE / "_peft_dist_worker.py", WORLD_SIZE, lambda r: [str(out)])
    return out


def _unsharded_reference(model: PeftModel, kind: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """``(names in refit order, tensors)`` the unsharded model gives."""
    if kind == "merged":
        merged = copy.deepcopy(model).merge_and_unload()
        names = list(DTensorRefitSource(merged).prepare_refit_info())
        return names, merged.state_dict()
    tensors = get_peft_model_state_dict(model, save_embedding_layers=False)
    return list(tensors), tensors


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_peft_stream_equals_unsharded_model(
    streamed: Path, build_peft: Callable[..., PeftModel], case: str, rank: int
) -> None:
    kind, dtype_name, kwargs = CASES[case]
    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    names, reference = _unsharded_reference(build_peft(**kwargs), kind)
    tensors, meta = _harness._read(streamed, case, rank)
    assert meta["order"] == names
    assert [name for name, _, _ in meta["manifest"]] == names
    assert_stream_matches(meta, tensors, reference, dtype)
