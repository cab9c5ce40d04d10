"""Tiny transformers models from the LAYOUTS.md §2 configs (no downloads), with random weights.

Imported by the tests (by path, through ``conftest.py``) and by the spawned
distributed worker script, so both build bit-identical models.
"""

from __future__ import annotations

import copy
from typing import Any

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

from aiosync.engines.embedded.configs import (
    TINY_GEMMA4_MOE,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    TINY_QWEN3_NEXT,
)

MODEL_KINDS = ("qwen3", "qwen3_tied", "qwen3_moe", "qwen3_next", "gemma4_moe", "gemma4_multimodal")


def _kw(config: dict[str, Any], **over: Any) -> dict[str, Any]:
    """Config-class keyword arguments from a ``aiosync.engines.embedded.configs`` dict."""
    return {k: copy.deepcopy(v) for k, v in config.items() if k != "model_type"} | over


def _gemma4_text_config() -> Gemma4TextConfig:
    """26B-A4B-like: fused experts on disk, k_eq_v on the full-attention layer."""
    return Gemma4TextConfig(**_kw(TINY_GEMMA4_MOE))


def build_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A tiny fp32 model whose every weight is random (norms too, so a wrong
    mapping cannot hide behind ones/zeros)."""
    torch.manual_seed(seed)
    model: PreTrainedModel
    if kind in ("qwen3", "qwen3_tied"):
        model = Qwen3ForCausalLM(
            Qwen3Config(**_kw(TINY_QWEN3, tie_word_embeddings=kind == "qwen3_tied"))
        )
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**_kw(TINY_QWEN3_MOE)))
    elif kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**_kw(TINY_QWEN3_NEXT)))
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
