"""Tiny transformers models from the LAYOUTS.md §2 configs (no downloads), with random weights.

Imported by the tests (by path, through ``conftest.py``) and by the spawned
distributed worker script, so both build bit-identical models.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

MODEL_KINDS = ("qwen3", "qwen3_tied", "qwen3_moe", "qwen3_next", "gemma4_moe", "gemma4_multimodal")


def _gemma4_text_config() -> Gemma4TextConfig:
    """26B-A4B-like: fused experts on disk, k_eq_v on the full-attention layer."""
    return Gemma4TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
        hidden_size_per_layer_input=0,
        sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )


def build_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A tiny fp32 model whose every weight is random (norms too, so a wrong
    mapping cannot hide behind ones/zeros)."""
    torch.manual_seed(seed)
    model: PreTrainedModel
    if kind in ("qwen3", "qwen3_tied"):
        model = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                tie_word_embeddings=kind == "qwen3_tied",
            )
        )
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=96,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                mlp_only_layers=[1],
                norm_topk_prob=True,
            )
        )
    elif kind == "qwen3_next":
        model = Qwen3NextForCausalLM(
            Qwen3NextConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=96,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=12,
                linear_conv_kernel_dim=4,
            )
        )
    elif kind == "gemma4_moe":
        model = Gemma4ForCausalLM(_gemma4_text_config())
    elif kind == "gemma4_multimodal":
        model = Gemma4ForConditionalGeneration(
            Gemma4Config(text_config=_gemma4_text_config(), vision_config=None, audio_config=None)
        )
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()
