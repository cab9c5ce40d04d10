"""PEFT configurations the refits do not support fail when the source is built, with a
typed error naming the option (ValueError; TypeError for a model that is not a PEFT model)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft import (
    IA3Config,
    LoraConfig,
    PeftModel,
    PrefixTuningConfig,
    get_peft_model,
)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from aiosync.engines.embedded.configs import TINY_QWEN3_MOE
from aiosync.refit import DTensorRefitSource, LoRAAdapterRefitSource

BuildPeft = Callable[..., PeftModel]
SOURCES = {"merged": DTensorRefitSource, "adapter": LoRAAdapterRefitSource}


def _ia3(build_base: Callable[..., torch.nn.Module]) -> PeftModel:
    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    return get_peft_model(build_base(), config)


def _prefix_tuning(build_base: Callable[..., torch.nn.Module]) -> PeftModel:
    return get_peft_model(
        build_base(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )


def _moe_experts() -> PeftModel:
    # The tiny MoE's sizes, one (MoE) layer.
    sizes = "vocab_size hidden_size intermediate_size moe_intermediate_size num_experts"
    heads = "num_experts_per_tok num_attention_heads num_key_value_heads"
    kept = {k: TINY_QWEN3_MOE[k] for k in f"{sizes} {heads}".split()}
    config = Qwen3MoeConfig(**kept, num_hidden_layers=1, head_dim=16)
    lora = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    return get_peft_model(Qwen3MoeForCausalLM(config), lora)


def _two_active(build_peft: BuildPeft) -> PeftModel:
    model = build_peft(extra_adapters={"second": {}})
    model.base_model.set_adapter(["default", "second"])
    return model


# case -> (model builder, the error's words)
CASES: dict[str, tuple[Callable[[BuildPeft, Any], PeftModel], str]] = {
    "dora": (lambda b, _: b(use_dora=True), "use_dora=True"),
    "ia3": (lambda _, base: _ia3(base), "peft_type=IA3"),
    "prefix_tuning": (lambda _, base: _prefix_tuning(base), "peft_type=PREFIX_TUNING"),
    "two_active_adapters": (lambda b, _: _two_active(b), "several active adapters"),
    "lora_on_embeddings": (
        lambda b, _: b(target_modules=["embed_tokens", "q_proj"]),
        r"LoRA on model\.embed_tokens \(Embedding\)",
    ),
    "target_parameters_moe_experts": (lambda _, __: _moe_experts(), "target_parameters="),
    "lora_bias": (lambda b, _: b(lora_bias=True, config={"attention_bias": True}), "lora_bias="),
    "trainable_token_indices": (
        lambda b, _: b(trainable_token_indices=[1, 2]),
        "trainable_token_indices=",
    ),
}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_configuration_is_a_value_error_naming_it(
    build_peft: BuildPeft,
    build_base: Callable[..., torch.nn.Module],
    case: str,
    source: str,
) -> None:
    build, words = CASES[case]
    model = build(build_peft, build_base)
    with pytest.raises(ValueError, match=words):
        SOURCES[source](model)


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\].*DTensorRefitSource"),
        ({"bias": "all", "config": {"attention_bias": True}}, "bias='all'"),
        ({"bias": "lora_only", "config": {"attention_bias": True}}, "bias='lora_only'"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
    ],
    ids=["modules_to_save", "bias_all", "bias_lora_only", "pissa", "olora"],
)
def test_what_an_adapter_cannot_carry_is_refused_naming_it(
    build_peft: BuildPeft, lora: dict[str, Any], words: str
) -> None:
    model = build_peft(**lora)
    with pytest.raises(ValueError, match=words):
        LoRAAdapterRefitSource(model)
    DTensorRefitSource(model).prepare_refit_info()  # the merged refit takes it


def test_merged_lora_on_a_tied_weight_is_refused(build_peft: BuildPeft) -> None:
    model = build_peft(config={"tie_word_embeddings": True}, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"LoRA on lm_head, whose weight is tied"):
        DTensorRefitSource(model)


def test_merged_refit_of_adapters_merged_in_place_is_refused(build_peft: BuildPeft) -> None:
    model = build_peft(target_modules=["q_proj"])
    model.merge_adapter()
    with pytest.raises(ValueError, match=r"merge_adapter\(\)"):
        DTensorRefitSource(model)


def test_adapter_layers_without_their_peft_model_are_refused(build_peft: BuildPeft) -> None:
    model = build_peft()
    with pytest.raises(ValueError, match="not the PeftModel"):
        DTensorRefitSource(model.base_model)
    with pytest.raises(ValueError, match="not the PeftModel"):
        DTensorRefitSource(model.get_base_model())
    with pytest.raises(TypeError, match="expected a peft"):
        LoRAAdapterRefitSource(copy.deepcopy(model).merge_and_unload())
