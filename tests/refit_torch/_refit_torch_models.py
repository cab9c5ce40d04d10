"""Tiny transformers models from the LAYOUTS.md §2 configs (no downloads), with random weights.

Imported by the tests (by path, through ``conftest.py``) and by the spawned
distributed worker script, so both build bit-identical models.
"""

from __future__ import annotations

import torch
from transformers import (
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

MODEL_KINDS = ("qwen3", "qwen3_tied", "qwen3_moe")


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
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()
