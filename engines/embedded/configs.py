"""Tiny HF configs that build in seconds on a CPU (LAYOUTS.md §2), for tests and examples.

Each is a plain dict with ``model_type``, as :meth:`HFModelRunner.from_config`
and :class:`EmbeddedEngine` take it. Copy before changing (``{**TINY_QWEN3, ...}``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TINY_GEMMA4_MOE",
    "TINY_QWEN3",
    "TINY_QWEN3_MOE",
    "TINY_QWEN3_NEXT",
    "TINY_QWEN3_TIED",
]

#: Dense Qwen3, untied head: 25 checkpoint tensors, ~0.2 M parameters.
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

#: Qwen3-Next: gated-DeltaNet layers 0-2, full attention on layer 3, MoE + shared expert.
TINY_QWEN3_NEXT: dict[str, Any] = {
    "model_type": "qwen3_next",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
}

#: Gemma 4 text, 26B-A4B-like: fused experts on every layer, k_eq_v on the full layer, no PLE.
TINY_GEMMA4_MOE: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 24,
    "hidden_size_per_layer_input": 0,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}
