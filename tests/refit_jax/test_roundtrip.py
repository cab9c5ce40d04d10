"""HF checkpoint → JAX layout → HF reproduces the checkpoint bit for bit, per family."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

jax = pytest.importorskip("jax")

from aiosync.refit.nnx import model_map_for  # noqa: E402
from aiosync.refit.nnx.table import flatten_params  # noqa: E402

# (id, builder name in _refit_jax_models, config overrides)
FAMILIES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen3", "qwen3_config", {}),
    ("qwen3_tied", "qwen3_config", {"tie_word_embeddings": True}),
    ("qwen3_attention_bias", "qwen3_config", {"attention_bias": True}),
    ("qwen3_moe", "qwen3_moe_config", {}),
    (
        "qwen3_moe_sparse_step2",
        "qwen3_moe_config",
        {"decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    ("qwen3_next", "qwen3_next_config", {}),
    ("qwen3_next_dense_layer", "qwen3_next_config", {"mlp_only_layers": [0]}),
    ("gemma4_text_moe", "gemma4_text_config", {}),
    ("gemma4_text_e2b", "gemma4_e2b_config", {}),
    ("gemma4_multimodal", "gemma4_config", {}),
]

_cache: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
_models_cache: dict[str, torch.nn.Module] = {}


def _checkpoint(models: ModuleType, case: str) -> tuple[Any, dict[str, torch.Tensor]]:
    if case not in _cache:
        _, builder, over = next(f for f in FAMILIES if f[0] == case)
        config = getattr(models, builder)(**over)
        model = models.build(config)
        _models_cache[case] = model
        _cache[case] = (config, models.checkpoint_state(model))
    return _cache[case]


@pytest.fixture
def checkpoint(models: ModuleType) -> Callable[[str], tuple[Any, dict[str, torch.Tensor]]]:
    return lambda case: _checkpoint(models, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [f[0] for f in FAMILIES])
def test_checkpoint_round_trips_bit_exact(
    checkpoint: Callable[[str], tuple[Any, dict[str, torch.Tensor]]],
    models: ModuleType,
    case: str,
    dtype: torch.dtype,
) -> None:
    config, state = checkpoint(case)
    state = {k: v.to(dtype) for k, v in state.items()}
    model_map = model_map_for(config)

    params = model_map.to_jax(state)
    flat = flatten_params(params)
    assert {p: tuple(a.shape) for p, a in flat.items()} == model_map.nnx_shapes()
    assert {str(a.dtype) for a in flat.values()} == {str(dtype).removeprefix("torch.")}

    out = list(model_map.to_hf(params))
    names = [name for name, _ in out]
    assert len(names) == len(set(names))
    assert set(names) == set(state)
    assert names == list(model_map.manifest(params))
    for name, tensor in out:
        ref = state[name]
        assert tensor.dtype == ref.dtype, name
        assert tuple(tensor.shape) == tuple(ref.shape), name
        assert tensor.is_contiguous(), name
        assert models.bytes_of(tensor) == models.bytes_of(ref), name


@pytest.mark.parametrize("case", [f[0] for f in FAMILIES])
def test_stream_order_is_the_order_transformers_saves(models: ModuleType, case: str) -> None:
    # The oracle is transformers' own reversal of the in-memory state dict (what
    # save_pretrained writes, in its order, minus the tied lm_head); the torch seam
    # streams in this order too, so both seams give the engine the same manifest.
    from transformers.core_model_loading import revert_weight_conversion

    config, state = _checkpoint(models, case)
    model = _models_cache[case]
    expected = [k for k in revert_weight_conversion(model, dict(model.state_dict())) if k in state]
    model_map = model_map_for(config)
    assert list(model_map.hf_shapes()) == expected
    params = model_map.to_jax(state)
    assert [name for name, _ in model_map.to_hf(params)] == expected


def test_qwen3_moe_streams_every_expert_of_a_projection_together(models: ModuleType) -> None:
    config, state = _checkpoint(models, "qwen3_moe")
    model_map = model_map_for(config)
    names = [name for name, _ in model_map.to_hf(model_map.to_jax(state))]
    experts = [n for n in names if n.startswith("model.layers.0.mlp.experts.")]
    assert experts == (
        [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)]
        + [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)]
        + [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    )
