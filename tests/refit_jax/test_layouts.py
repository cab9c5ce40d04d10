"""The JAX side holds tunix's layouts, pinned element by element against the HF tensors."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")

from aiosync.refit.nnx import model_map_for  # noqa: E402


def _load(models: ModuleType, builder: str, **over: Any) -> tuple[dict[str, torch.Tensor], Any]:
    config = getattr(models, builder)(**over)
    state = models.checkpoint_state(models.build(config))
    return state, model_map_for(config).to_jax(state)


def _np(x: Any) -> np.ndarray:
    return np.asarray(x)


def _t(x: torch.Tensor) -> np.ndarray:
    return x.numpy()


def test_qwen3_kernels_are_transposed_and_heads_split(models: ModuleType) -> None:
    state, params = _load(models, "qwen3_config")
    n, k, d, h = 4, 2, 32, 64
    attn = params["layers"][1]["attn"]
    q = _t(state["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(_np(attn["q_proj"]["w"]), q.T.reshape(h, n, d))
    kk = _t(state["model.layers.1.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(_np(attn["k_proj"]["w"]), kk.T.reshape(h, k, d))
    o = _t(state["model.layers.1.self_attn.o_proj.weight"])
    np.testing.assert_array_equal(_np(attn["o_proj"]["w"]), o.T.reshape(n, d, h))
    down = _t(state["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(_np(params["layers"][1]["mlp"]["down_proj"]["kernel"]), down.T)
    np.testing.assert_array_equal(_np(params["lm_head"]["w"]), _t(state["lm_head.weight"]).T)


def test_qwen3_tied_has_no_lm_head_on_either_side(models: ModuleType) -> None:
    state, params = _load(models, "qwen3_config", tie_word_embeddings=True)
    assert "lm_head.weight" not in state
    assert "lm_head" not in params


def test_qwen3_moe_experts_stack_per_expert_transposes(models: ModuleType) -> None:
    state, params = _load(models, "qwen3_moe_config")
    mlp = params["layers"][0]["mlp"]
    assert _np(mlp["gate_proj"]).shape == (4, 64, 32)
    assert _np(mlp["down_proj"]).shape == (4, 32, 64)
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}."
        np.testing.assert_array_equal(_np(mlp["gate_proj"])[e], _t(state[f"{p}gate_proj.weight"]).T)
        np.testing.assert_array_equal(_np(mlp["up_proj"])[e], _t(state[f"{p}up_proj.weight"]).T)
        np.testing.assert_array_equal(_np(mlp["down_proj"])[e], _t(state[f"{p}down_proj.weight"]).T)
    router = _np(mlp["router"]["kernel"])
    np.testing.assert_array_equal(router, _t(state["model.layers.0.mlp.gate.weight"]).T)
    # mlp_only_layers=[1]: layer 1 stays a dense MLP.
    assert set(params["layers"][1]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    assert _np(params["layers"][1]["mlp"]["gate_proj"]["kernel"]).shape == (64, 96)


def test_qwen3_next_q_proj_gate_is_deinterleaved_per_head(models: ModuleType) -> None:
    state, params = _load(models, "qwen3_next_config")
    n, d, h = 4, 16, 64
    w = _t(state["model.layers.3.self_attn.q_proj.weight"]).reshape(n, 2 * d, h)
    attn = params["layers"][3]["attn"]
    np.testing.assert_array_equal(_np(attn["q_proj"]["w"]), w[:, :d].transpose(2, 0, 1))
    np.testing.assert_array_equal(_np(attn["q_gate"]["w"]), w[:, d:].transpose(2, 0, 1))
    # Layers 0-2 are linear attention (full_attention_interval=4).
    lin = params["layers"][0]["linear_attn"]
    conv = _t(state["model.layers.0.linear_attn.conv1d.weight"])
    np.testing.assert_array_equal(_np(lin["conv1d"]["kernel"]), conv.transpose(2, 1, 0))
    np.testing.assert_array_equal(_np(lin["A_log"]), _t(state["model.layers.0.linear_attn.A_log"]))
    assert "self_attn" not in params["layers"][0] and "attn" not in params["layers"][0]
    shared_gate = _t(state["model.layers.0.mlp.shared_expert_gate.weight"])
    np.testing.assert_array_equal(
        _np(params["layers"][0]["mlp"]["shared_expert_gate"]["kernel"]), shared_gate.T
    )


def test_gemma4_moe_keeps_experts_fused_and_k_eq_v_has_no_v(models: ModuleType) -> None:
    state, params = _load(models, "gemma4_text_config")
    e, im, h = 4, 24, 64
    moe = params["layers"][0]["moe"]
    gate_up = _t(state["model.layers.0.experts.gate_up_proj"])
    np.testing.assert_array_equal(_np(moe["gating_einsum"]), gate_up.reshape(e, 2, im, h))
    np.testing.assert_array_equal(_np(moe["gating_einsum"])[:, 0], gate_up[:, :im])
    down = _t(state["model.layers.0.experts.down_proj"])
    np.testing.assert_array_equal(_np(moe["linear"]), down.transpose(0, 2, 1))
    np.testing.assert_array_equal(
        _np(moe["router_logits"]), _t(state["model.layers.0.router.proj.weight"]).T
    )
    # Sliding layer: k and v fused as (2, K, H, D); full k_eq_v layer 5: k only, 1 global kv head.
    kv = _np(params["layers"][0]["attn"]["kv_einsum"]["w"])
    v = _t(state["model.layers.0.self_attn.v_proj.weight"])
    np.testing.assert_array_equal(kv[1], v.reshape(2, 16, h).transpose(0, 2, 1))
    assert "model.layers.5.self_attn.v_proj.weight" not in state
    assert _np(params["layers"][5]["attn"]["k_einsum"]["w"]).shape == (1, h, 32)
    assert _np(params["layers"][5]["attn"]["q_einsum"]["w"]).shape == (4, h, 32)
    np.testing.assert_array_equal(
        _np(params["layers"][2]["skip_scale"]), _t(state["model.layers.2.layer_scalar"])
    )


def test_gemma4_ple_table_splits_per_layer_and_shared_layers_have_no_kv(
    models: ModuleType,
) -> None:
    state, params = _load(models, "gemma4_e2b_config")
    n_layers, p = 5, 8
    table = _t(state["model.embed_tokens_per_layer.weight"])
    ple = _np(params["embedder"]["per_layer_input_embedding"])
    assert ple.shape == (128, n_layers, p)
    np.testing.assert_array_equal(ple[:, 3], table[:, 3 * p : 4 * p])
    # Layers 3 and 4 share KV: no k/v/k_norm; double-wide MLP (2 * 96).
    for layer in (3, 4):
        attn = params["layers"][layer]["attn"]
        assert set(attn) == {"q_einsum", "query_norm", "attn_vec_einsum"}
        assert _np(params["layers"][layer]["mlp"]["gating_einsum"]).shape == (2, 192, 64)
    assert not any(".layers.3.self_attn.k" in n or ".layers.3.self_attn.v" in n for n in state)


def test_gemma4_multimodal_names_live_under_language_model(models: ModuleType) -> None:
    config = models.gemma4_config()
    state = models.checkpoint_state(models.build(config))
    model_map = model_map_for(config)
    assert all(n.startswith("model.language_model.") for n in model_map.hf_shapes())
    # Vision/audio tower tensors are skipped by the loader, not an error.
    state["model.vision_tower.patch_embedder.weight"] = torch.zeros(2, 2)
    params = model_map.to_jax(state)
    assert {n for n, _ in model_map.to_hf(params)} == set(state) - {
        "model.vision_tower.patch_embedder.weight"
    }


def test_config_json_dict_gives_the_same_map_as_the_config_object(models: ModuleType) -> None:
    for builder in (
        "qwen3_moe_config",
        "qwen3_next_config",
        "gemma4_text_config",
        "gemma4_e2b_config",
        "gemma4_config",
    ):
        config = getattr(models, builder)()
        as_dict = config.to_dict()
        assert model_map_for(as_dict).hf_shapes() == model_map_for(config).hf_shapes(), builder


def test_original_gemma4_config_json_fields_give_global_head_dims() -> None:
    # The published config.json: global_head_dim and num_global_key_value_heads,
    # no per_layer_config.
    raw = {
        "model_type": "gemma4_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    shapes = model_map_for(raw).hf_shapes()
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (128, 64)
    assert "model.layers.1.self_attn.v_proj.weight" not in shapes
    assert shapes["model.layers.0.self_attn.v_proj.weight"] == (32, 64)
