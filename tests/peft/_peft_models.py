"""Tiny Qwen3 models (no downloads) wrapped by PEFT, with random base weights and
random, nonzero adapters (PEFT starts ``lora_B`` at zero, which would make every
merge a no-op).

Imported by the tests (by path, through ``conftest.py``) and by the spawned
FSDP2 worker script, so both build bit-identical models.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync.engines.embedded.configs import TINY_QWEN3

#: A 2-layer Qwen3 small enough to build in well under a second.
QWEN3: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN3.items() if k != "model_type"},
    "head_dim": 16,
}

#: The LoRA every test starts from; ``init_lora_weights=False``: A and B both random.
LORA: dict[str, Any] = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": "all-linear",
    "init_lora_weights": False,
}


def build_base(seed: int = 0, **config: Any) -> Qwen3ForCausalLM:
    """A tiny fp32 Qwen3 whose every weight is random (norms too)."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**(QWEN3 | config)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def build_peft(
    seed: int = 0,
    *,
    config: dict[str, Any] | None = None,
    extra_adapters: dict[str, dict[str, Any]] | None = None,
    active: str | None = None,
    dtype: torch.dtype | None = None,
    **lora: Any,
) -> PeftModel:
    """``get_peft_model(build_base(seed, **config), LoraConfig(**(LORA | lora)))``.

    ``extra_adapters`` adds more adapters (``{name: LoraConfig overrides}``),
    ``active`` activates one. Every adapter tensor and ``modules_to_save`` copy
    is then drawn at random, as after training.
    """
    base = build_base(seed, **(config or {}))
    if dtype is not None:
        base = base.to(dtype)
    model = get_peft_model(base, LoraConfig(**(LORA | lora)))
    for name, overrides in (extra_adapters or {}).items():
        model.add_adapter(name, LoraConfig(**(LORA | overrides)))
    if active is not None:
        model.set_adapter(active)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name or ".modules_to_save." in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    return model.eval()


#: The 2-rank FSDP2 cases: ``{case: (source, manifest dtype name or None, build_peft kwargs)}``;
#: ``source`` is ``"merged"`` (DTensorRefitSource) or ``"adapter"`` (LoRAAdapterRefitSource).
FSDP2_CASES: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "merged_modules_to_save": ("merged", None, {"modules_to_save": ["lm_head"]}),
    "merged_tied_bf16": ("merged", "bfloat16", {"config": {"tie_word_embeddings": True}}),
    "merged_two_adapters": (
        "merged",
        None,
        {"extra_adapters": {"second": {"r": 2, "use_rslora": True}}, "active": "second"},
    ),
    "adapter": ("adapter", None, {}),
    "adapter_bf16_rank_pattern": ("adapter", "bfloat16", {"rank_pattern": {"q_proj": 8}}),
}
