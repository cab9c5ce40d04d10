"""The adapter-only refit: ``LoRAAdapterRefitSource`` streams the adapter exactly as
PEFT saves it (``get_peft_model_state_dict``, ``adapter_config.json``), and what it
streams loads back with ``PeftModel.from_pretrained`` into the trainer's model."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict

import aiosync
from aiosync.refit import DTensorRefitSource, LoRAAdapterRefitSource

BuildPeft = Callable[..., PeftModel]

CONFIGS: dict[str, dict[str, Any]] = {
    "all_linear": {},
    "list": {"target_modules": ["q_proj", "v_proj", "down_proj"]},
    "regex_one_layer": {"target_modules": r".*layers\.0\.self_attn\.(q|v)_proj"},
    "patterns_rslora": {
        "rank_pattern": {"q_proj": 8},
        "alpha_pattern": {"down_proj": 2},
        "use_rslora": True,
    },
    "layers_to_transform": {"target_modules": ["k_proj", "down_proj"], "layers_to_transform": [1]},
}


@pytest.mark.parametrize("lora", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["own", "bf16"])
def test_manifest_and_tensors_are_get_peft_model_state_dict(
    build_peft: BuildPeft, lora: dict[str, Any], dtype: torch.dtype | None
) -> None:
    model = build_peft(**lora)
    reference = get_peft_model_state_dict(model, save_embedding_layers=False)
    source = LoRAAdapterRefitSource(model, dtype=dtype)
    manifest = source.prepare_refit_info()
    assert list(manifest) == list(reference)
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in manifest)
    streamed = list(source.iter_weights())
    assert [name for name, _ in streamed] == list(reference)
    for name, tensor in streamed:
        expected = reference[name] if dtype is None else reference[name].to(dtype)
        assert manifest[name] == (tuple(expected.shape), expected.dtype), name
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor, expected), name


def test_names_are_peft_saved_names(build_peft: BuildPeft) -> None:
    manifest = LoRAAdapterRefitSource(build_peft(r=4)).prepare_refit_info()
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    assert manifest[f"{name}.lora_A.weight"] == ((4, 64), torch.float32)
    assert manifest[f"{name}.lora_B.weight"] == ((64, 4), torch.float32)


def test_streamed_tensors_do_not_alias_the_trainer(build_peft: BuildPeft) -> None:
    model = build_peft(target_modules=["q_proj"])
    streamed = dict(LoRAAdapterRefitSource(model).iter_weights())
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    param = model.get_base_model().model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert torch.equal(streamed[name], param)
    assert streamed[name].is_contiguous()
    with torch.no_grad():
        param.add_(1.0)  # an optimizer step
    assert not torch.equal(streamed[name], param)


@pytest.mark.parametrize("lora", list(CONFIGS.values()), ids=list(CONFIGS))
def test_config_is_json_and_rebuilds_a_lora_config(
    build_peft: BuildPeft, lora: dict[str, Any]
) -> None:
    model = build_peft(task_type="CAUSAL_LM", **lora)
    config = LoRAAdapterRefitSource(model).lora_adapter_config()
    assert json.loads(json.dumps(config)) == config
    assert config["peft_type"] == "LORA"
    assert config["task_type"] == "CAUSAL_LM"
    assert config["inference_mode"] is True
    assert "base_model_name_or_path" in config
    rebuilt = LoraConfig(**config)
    own = model.peft_config["default"]
    for field in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"):
        assert getattr(rebuilt, field) == getattr(own, field), field


def test_target_modules_resolved_to_suffixes(build_peft: BuildPeft) -> None:
    config = LoRAAdapterRefitSource(build_peft()).lora_adapter_config()
    expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_modules"] == expected
    # A regex targeting one layer keeps to it: its suffixes would target both layers.
    regex = LoRAAdapterRefitSource(build_peft(**CONFIGS["regex_one_layer"]))
    assert regex.lora_adapter_config()["target_modules"] == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]


def test_base_model_name_or_path_comes_from_the_base_model(build_peft: BuildPeft) -> None:
    model = build_peft()
    model.get_base_model().name_or_path = "Qwen/Qwen3-tiny"
    assert LoRAAdapterRefitSource(model).lora_adapter_config()["base_model_name_or_path"] == (
        "Qwen/Qwen3-tiny"
    )


@pytest.mark.parametrize("lora", list(CONFIGS.values()), ids=list(CONFIGS))
def test_saved_adapter_generates_exactly_as_the_trainer(
    build_peft: BuildPeft,
    build_base: Callable[..., torch.nn.Module],
    tmp_path: Path,
    lora: dict[str, Any],
) -> None:
    trainer = build_peft(**lora)
    source = LoRAAdapterRefitSource(trainer)
    adapter = aiosync.LoRAAdapter(
        aiosync.lora_adapter_name(1), 1, dict(source.iter_weights()), source.lora_adapter_config()
    )
    loaded = PeftModel.from_pretrained(build_base(), adapter.save(tmp_path)).eval()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        own = trainer.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
        got = loaded.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
        base = build_base().generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
    assert got.tolist() == own.tolist()
    assert own.tolist() != base.tolist()  # the adapter matters


def test_two_adapters_the_active_one_by_default_or_the_named_one(build_peft: BuildPeft) -> None:
    model = build_peft(
        target_modules=["q_proj"],
        extra_adapters={"second": {"r": 2, "target_modules": ["v_proj"]}},
        active="second",
    )
    active = LoRAAdapterRefitSource(model)
    assert active.adapter_name == "second"
    reference = get_peft_model_state_dict(model, adapter_name="second")
    assert list(active.prepare_refit_info()) == list(reference)
    assert all(torch.equal(t, reference[n]) for n, t in active.iter_weights())
    assert all(".v_proj." in n for n in reference)
    named = LoRAAdapterRefitSource(model, adapter_name="default")
    first = get_peft_model_state_dict(model, adapter_name="default")
    assert list(named.prepare_refit_info()) == list(first)
    assert named.lora_adapter_config()["target_modules"] == ["q_proj"]


def test_is_a_lora_adapter_source_and_the_merged_source_is_not(build_peft: BuildPeft) -> None:
    model = build_peft()
    assert isinstance(LoRAAdapterRefitSource(model), aiosync.LoRAAdapterSource)
    assert isinstance(LoRAAdapterRefitSource(model), aiosync.RefitSource)
    assert not isinstance(DTensorRefitSource(model), aiosync.LoRAAdapterSource)


def test_compiled_trainer_is_unwrapped(build_peft: BuildPeft) -> None:
    model = build_peft()
    compiled = torch.compile(model)
    source = LoRAAdapterRefitSource(compiled)  # type: ignore[arg-type]
    assert list(source.prepare_refit_info()) == list(get_peft_model_state_dict(model))


def test_arguments_are_checked(build_peft: BuildPeft) -> None:
    model = build_peft()
    with pytest.raises(TypeError, match="dtype"):
        LoRAAdapterRefitSource(model, dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="adapter_name"):
        LoRAAdapterRefitSource(model, adapter_name=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no adapter named 'other'"):
        LoRAAdapterRefitSource(model, adapter_name="other")
    with pytest.raises(TypeError, match=r"peft\.PeftModel"):
        LoRAAdapterRefitSource(copy.deepcopy(model).merge_and_unload())
