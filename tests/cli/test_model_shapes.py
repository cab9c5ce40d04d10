"""The stored real-model manifests follow the HF checkpoint layout transformers writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aiosync._model_shapes import MODEL_CONFIGS, manifest_bytes, model_manifest

SHARED_MODELS = Path(__file__).resolve().parents[2] / ".." / "shared" / "models"

TINY: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=False,
    ),
    "qwen3-tied": dict(
        model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mlp_only_layers=[1],
        norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", vocab_size=128, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


def _transformers_checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """What ``save_pretrained`` writes for ``config``: names and shapes, on meta tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    items = dict(config)
    hf_config = AutoConfig.for_model(items.pop("model_type"), **items)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, state).items()}


@pytest.mark.parametrize("name", list(TINY))
def test_manifest_matches_what_transformers_saves(name: str) -> None:
    ours = {k: shape for k, (shape, _) in model_manifest(TINY[name]).items()}
    assert ours == _transformers_checkpoint_shapes(TINY[name])


@pytest.mark.parametrize("name", [n for n in MODEL_CONFIGS if n != "qwen3-tiny"])
def test_stored_dimensions_equal_the_shared_model_configs(name: str) -> None:
    path = SHARED_MODELS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} is not in this checkout")
    shared = json.loads(path.read_text())
    assert {k: shared[k] for k in MODEL_CONFIGS[name]} == MODEL_CONFIGS[name]


def test_real_model_sizes_and_tensor_counts() -> None:
    qwen06 = model_manifest("qwen3-0.6b")
    assert "lm_head.weight" not in qwen06  # tied
    assert manifest_bytes(qwen06) == 2 * 596_049_920
    moe = model_manifest("qwen3-30b-a3b")
    assert len(moe) == 3 + 48 * (6 + 2 + 1 + 3 * 128)
    assert moe["model.layers.47.mlp.experts.127.down_proj.weight"] == ((2048, 768), "bfloat16")
    nxt = model_manifest("qwen3-next-80b-a3b", layers=4)
    assert nxt["model.layers.0.linear_attn.in_proj_qkvz.weight"][0] == (12288, 2048)
    assert nxt["model.layers.3.self_attn.q_proj.weight"][0] == (8192, 2048)
    assert len(model_manifest("qwen3-8b", layers=2)) == 3 + 2 * 11


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"qwen3-0\.6b"):
        model_manifest("llama-7b")
