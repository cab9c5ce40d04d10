"""Tiny HF configs that build in seconds on a CPU (LAYOUTS.md §2), for tests and examples.

Each is a plain dict with ``model_type``, as :meth:`HFModelRunner.from_config`
and :class:`EmbeddedEngine` take it. Copy before changing (``{**TINY_QWEN3, ...}``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_QWEN3", "TINY_QWEN3_MOE", "TINY_QWEN3_TIED"]

#: Dense Qwen3, untied head: 24 checkpoint tensors, ~0.2 M parameters.
TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "tie_word_embeddings": False,
}

#: Dense Qwen3 with ``lm_head`` tied to the embedding (absent from the checkpoint).
TINY_QWEN3_TIED: dict[str, Any] = {**TINY_QWEN3, "tie_word_embeddings": True}

#: Qwen3-MoE: 4 experts (fused in memory, per-expert in the checkpoint), layer 1 dense.
TINY_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
}
