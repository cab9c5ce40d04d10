"""DTensor and FSDP2 models on a real 2-rank gloo group stream the unsharded checkpoint.

One spawn of two real processes (``_dist_worker.py``) runs every case and saves
what each rank streamed; the tests compare it, name for name and bit for bit,
with ``save_pretrained`` of the same model unsharded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests._support.checks import assert_stream_matches

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
WORLD_SIZE = 2

# case -> (model kind, manifest dtype or None); mirrors the cases in _dist_worker.py
CASES: dict[str, tuple[str, torch.dtype | None]] = {
    "fsdp2_qwen3_tied": ("qwen3_tied", None),
    "fsdp2_qwen3_moe_bf16": ("qwen3_moe", torch.bfloat16),
    "fsdp2_compiled_qwen3": ("qwen3", None),
    "fsdp2_qwen3_next_bf16": ("qwen3_next", torch.bfloat16),
    "dtensor_qwen3_tied": ("qwen3_tied", None),
    "dtensor_qwen3_moe": ("qwen3_moe", None),
    "fsdp2_qwen3_tied_bf16_into": ("qwen3_tied", torch.bfloat16),
}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> Path:
    """Run both ranks once; the directory of their outputs."""
    out = tmp_path_factory.mktemp("dist")
    spawn_ranks(HERE / "_dist_worker.py", WORLD_SIZE, lambda r: [str(out)])
    return out


def _read(out: Path, case: str, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, list]]:  # type: ignore[type-arg]
    tensors = load_file(str(out / f"{case}.rank{rank}.safetensors"))
    meta = json.loads((out / f"{case}.rank{rank}.json").read_text())
    return tensors, meta


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_stream_equals_unsharded_save_pretrained(
    streamed: Path,
    saved_checkpoint: Callable[[str], dict[str, torch.Tensor]],
    case: str,
    rank: int,
) -> None:
    kind, dtype = CASES[case]
    reference = saved_checkpoint(kind)
    tensors, meta = _read(streamed, case, rank)
    manifest_names = [name for name, _, _ in meta["manifest"]]
    assert meta["order"] == manifest_names
    assert sorted(manifest_names) == sorted(reference)
    assert_stream_matches(meta, tensors, reference, dtype)


@pytest.mark.parametrize("case", ["fsdp2_qwen3_tied", "dtensor_qwen3_tied"])
def test_sharded_tied_embeddings_streamed_once(streamed: Path, case: str) -> None:
    for rank in range(WORLD_SIZE):
        _, meta = _read(streamed, case, rank)
        assert "lm_head.weight" not in meta["order"]
        assert meta["order"].count("model.embed_tokens.weight") == 1


@pytest.mark.parametrize("case", ["fsdp2_qwen3_moe_bf16", "dtensor_qwen3_moe"])
def test_sharded_moe_streams_per_expert_checkpoint_names(streamed: Path, case: str) -> None:
    _, meta = _read(streamed, case, 0)
    names = set(meta["order"])
    for layer in (0, 2, 3):  # layer 1 is in mlp_only_layers: dense
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" not in names
    assert "model.layers.1.mlp.gate_proj.weight" in names


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_gathers_into_the_memory_offered_where_it_fits_it(streamed: Path, rank: int) -> None:
    # Every tensor of the tiny Qwen3 is sharded on dim 0 in equal halves: each offer of
    # the manifest's dtype took the gather itself; the float64 offers (every third
    # name) did not, and those tensors were gathered into new memory. The values are
    # checked against save_pretrained above.
    _, meta = _read(streamed, "fsdp2_qwen3_tied_bf16_into", rank)
    order = meta["order"]
    assert meta["offered"] == order
    assert meta["gathered_into"] == [n for i, n in enumerate(order) if i % 3 != 2]
