"""Bad input fails before any byte moves, with an error naming the key."""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import pytest
import torch

from aiosync.errors import RefitMismatchError
from aiosync.refit.nnx import SUPPORTED_MODEL_TYPES, model_map_for

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def test_unsupported_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'llama'") as info:
        model_map_for({"model_type": "llama"})
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)
    assert set(SUPPORTED_MODEL_TYPES) == {
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "gemma4",
        "gemma4_text",
    }
    with pytest.raises(ValueError, match="None"):
        model_map_for({})


def _to_jax_refuses(config: Any, state: dict[str, torch.Tensor], match: str) -> None:
    """Converting ``state`` to NNX params raises ``RefitMismatchError`` matching ``match``."""
    with pytest.raises(RefitMismatchError, match=match):
        model_map_for(config).to_jax(state)


def test_missing_hf_key_is_named(moe: tuple[Any, dict[str, torch.Tensor]]) -> None:
    config, state = moe
    state = dict(state)
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    _to_jax_refuses(config, state, re.escape("model.layers.2.mlp.experts.3.up_proj.weight"))


def test_extra_hf_key_is_named(moe: tuple[Any, dict[str, torch.Tensor]]) -> None:
    config, state = moe
    # Per-expert weights on a layer that mlp_only_layers makes dense.
    state = {**state, "model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)}
    _to_jax_refuses(config, state, re.escape("model.layers.1.mlp.experts.0.gate_proj"))


def test_fused_experts_in_a_per_expert_family_are_unknown_keys(
    moe: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    config, state = moe
    state = {**state, "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 64)}
    _to_jax_refuses(config, state, re.escape("model.layers.0.mlp.experts.gate_up_proj"))


def test_wrong_hf_shape_is_named_with_both_shapes(moe: tuple[Any, dict[str, torch.Tensor]]) -> None:
    config, state = moe
    state = {**state, "model.layers.3.self_attn.k_proj.weight": torch.zeros(32, 64)}
    _to_jax_refuses(
        config, state, r"'model\.layers\.3\.self_attn\.k_proj\.weight'.*\(32, 64\).*\(64, 64\)"
    )


def test_mixed_dtypes_in_one_fused_array_are_rejected(
    moe: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    config, state = moe
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    state = {**state, name: state[name].to(torch.bfloat16)}
    with pytest.raises(RefitMismatchError, match=re.escape(name)):
        model_map_for(config).to_jax(state)


def test_nnx_state_missing_array_names_path_and_hf_key(
    moe_params: tuple[Any, Any],
) -> None:
    model_map, params = moe_params
    del params["layers"][2]["mlp"]["router"]
    with pytest.raises(
        RefitMismatchError, match=r"layers/2/mlp/router/kernel.*model\.layers\.2\.mlp\.gate\.weight"
    ):
        model_map.to_hf(params)


def test_nnx_state_wrong_shape_fails_before_the_first_tensor(
    moe_params: tuple[Any, Any],
) -> None:
    model_map, params = moe_params
    params["layers"][3]["mlp"]["down_proj"] = jnp.zeros((3, 32, 64))
    # to_hf validates eagerly: the error comes from the call, not from a later next().
    with pytest.raises(
        RefitMismatchError, match=r"layers/3/mlp/down_proj.*\(3, 32, 64\).*\(4, 32, 64\)"
    ):
        model_map.to_hf(params)


def test_nnx_state_unknown_array_is_named(moe: tuple[Any, dict[str, torch.Tensor]]) -> None:
    config, state = moe
    model_map = model_map_for(config)
    params = model_map.to_jax(state)
    params["layers"][0]["attn"]["q_proj"]["b"] = jnp.zeros((4, 32))
    with pytest.raises(RefitMismatchError, match=re.escape("layers/0/attn/q_proj/b")):
        model_map.manifest(params)
    # Non-strict refits ignore arrays the map does not know (e.g. a LoRA adapter).
    assert len(list(model_map.to_hf(params, strict=False))) == len(state)


def test_malformed_layer_types_are_rejected(models: ModuleType) -> None:
    raw = models.qwen3_next_config().to_dict()
    raw["layer_types"] = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        model_map_for(raw)
