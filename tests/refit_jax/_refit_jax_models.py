"""Tiny HF models (``../shared/LAYOUTS.md`` §2 configs) and their ``save_pretrained`` state."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aiosync.engines.embedded.configs import (
    TINY_GEMMA4_MOE,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    TINY_QWEN3_NEXT,
)

S, F = "sliding_attention", "full_attention"


def _kw(config: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a ``aiosync.engines.embedded.configs`` dict without ``model_type``."""
    return {k: copy.deepcopy(v) for k, v in config.items() if k != "model_type"}


def _require_gemma4() -> None:
    # transformers < 5.24 has no Gemma 4: its tests skip (the map itself needs no transformers).
    pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")


def qwen3_config(**over: Any) -> Any:
    from transformers import Qwen3Config

    kw: dict[str, Any] = _kw(TINY_QWEN3)
    kw.update(over)
    return Qwen3Config(**kw)


def qwen3_moe_config(**over: Any) -> Any:
    from transformers import Qwen3MoeConfig

    kw: dict[str, Any] = _kw(TINY_QWEN3_MOE)
    kw.update(over)
    return Qwen3MoeConfig(**kw)


def qwen3_next_config(**over: Any) -> Any:
    from transformers import Qwen3NextConfig

    kw: dict[str, Any] = _kw(TINY_QWEN3_NEXT)
    kw.update(over)
    return Qwen3NextConfig(**kw)


def gemma4_text_config(**over: Any) -> Any:
    """26B-A4B-like: MoE on every layer, k_eq_v full layer, no PLE."""
    _require_gemma4()
    from transformers import Gemma4TextConfig

    kw: dict[str, Any] = _kw(TINY_GEMMA4_MOE)
    kw.update(over)
    return Gemma4TextConfig(**kw)


def gemma4_e2b_config(**over: Any) -> Any:
    """E2B-like: PLE, KV-shared layers, double-wide MLP, no MoE."""
    kw: dict[str, Any] = dict(
        num_hidden_layers=5,
        num_key_value_heads=1,
        enable_moe_block=False,
        num_experts=None,
        top_k_experts=None,
        moe_intermediate_size=None,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        layer_types=[S, S, F, S, F],
    )
    kw.update(over)
    return gemma4_text_config(**kw)


def gemma4_config(**over: Any) -> Any:
    """The multimodal wrapper with no vision/audio tower: ``model.language_model.*`` names."""
    _require_gemma4()
    from transformers import Gemma4Config

    return Gemma4Config(
        text_config=gemma4_text_config(**over), vision_config=None, audio_config=None
    )


def build(config: Any, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random HF model for ``config`` (``ForConditionalGeneration`` for ``gemma4``)."""
    import transformers

    cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen3_next": transformers.Qwen3NextForCausalLM,
        "gemma4_text": transformers.Gemma4ForCausalLM,
        "gemma4": transformers.Gemma4ForConditionalGeneration,
    }[config.model_type]
    torch.manual_seed(seed)
    model = cls(config).eval()
    if config.model_type in ("gemma4_text", "gemma4"):
        # layer_scalar is a buffer initialised to ones: randomise it so the test sees it move.
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("layer_scalar"):
                    buf.uniform_(0.5, 1.5)
    return model.to(dtype)


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes: the HF checkpoint names, shapes and dtypes."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # type: ignore[operator]
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(f))
    return state


def bytes_of(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (so -0.0 vs 0.0 or NaN payloads would differ)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
