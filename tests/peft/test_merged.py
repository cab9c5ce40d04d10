"""A PEFT LoRA trainer refit merged: ``DTensorRefitSource(peft_model)`` streams the base
model's checkpoint with the active adapter merged, bit for bit what
``merge_and_unload()`` gives, without touching the trainer's modules."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from aiosync.errors import RefitMismatchError
from aiosync.refit import DTensorRefitSource

BuildPeft = Callable[..., PeftModel]


def _merged_reference(model: PeftModel) -> tuple[list[str], dict[str, torch.Tensor]]:
    """What ``merge_and_unload()`` of a copy gives: its refit names (the base model's
    checkpoint order) and its state dict."""
    merged = copy.deepcopy(model).merge_and_unload()
    return list(DTensorRefitSource(merged).prepare_refit_info()), merged.state_dict()


def _assert_streams_merge_and_unload(
    model: PeftModel, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The source's manifest, order and tensors equal ``merge_and_unload()``'s (cast to
    ``dtype``), bit for bit, and iterating leaves the trainer's tensors as they were."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names, reference = _merged_reference(model)
    source = DTensorRefitSource(model, dtype=dtype)
    manifest = source.prepare_refit_info()
    streamed = list(source.iter_weights())
    assert list(manifest) == names
    assert [name for name, _ in streamed] == names
    for name, tensor in streamed:
        expected = reference[name] if dtype is None else reference[name].to(dtype)
        assert manifest[name] == (tuple(expected.shape), expected.dtype), name
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor, expected), name
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} was modified"
    return dict(streamed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_refit_equals_merge_and_unload_bit_for_bit(
    build_peft: BuildPeft, build_base: Callable[..., torch.nn.Module], dtype: torch.dtype
) -> None:
    model = build_peft()
    streamed = _assert_streams_merge_and_unload(model, dtype)
    # The base model's names, shapes and order: what its own source streams.
    base = DTensorRefitSource(build_base(), dtype=dtype).prepare_refit_info()
    assert DTensorRefitSource(model, dtype=dtype).prepare_refit_info() == base
    # The adapter really changed the targeted weights (and nothing else).
    plain = dict(DTensorRefitSource(build_base(), dtype=dtype).iter_weights())
    changed = {n for n in base if not torch.equal(streamed[n], plain[n])}
    assert changed == {n for n in base if n.endswith("_proj.weight")}


def test_merged_names_are_what_merge_and_unload_save_pretrained_writes(
    build_peft: BuildPeft, tmp_path: Path
) -> None:
    model = build_peft()
    copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    streamed = dict(DTensorRefitSource(model).iter_weights())
    assert sorted(streamed) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(streamed[name], tensor), name


def test_use_rslora_scales_by_alpha_over_sqrt_r(build_peft: BuildPeft) -> None:
    _assert_streams_merge_and_unload(build_peft(r=9, lora_alpha=6, use_rslora=True))


def test_rank_and_alpha_patterns_scale_each_module_as_peft(build_peft: BuildPeft) -> None:
    model = build_peft(
        rank_pattern={"q_proj": 8, r"model\.layers\.1\.mlp\.down_proj": 2},
        alpha_pattern={"v_proj": 32},
        use_rslora=True,
    )
    layers = model.get_base_model().model.layers
    assert layers[0].self_attn.q_proj.r["default"] == 8
    assert layers[1].mlp.down_proj.r["default"] == 2
    assert layers[0].self_attn.v_proj.lora_alpha["default"] == 32
    _assert_streams_merge_and_unload(model)


def test_target_modules_list_and_regex(build_peft: BuildPeft) -> None:
    _assert_streams_merge_and_unload(build_peft(target_modules=["q_proj", "down_proj"]))
    _assert_streams_merge_and_unload(
        build_peft(target_modules=r".*layers\.1\.self_attn\.(k|o)_proj"), torch.bfloat16
    )


def test_modules_to_save_sends_the_trained_copy_under_the_original_name(
    build_peft: BuildPeft,
) -> None:
    model = build_peft(target_modules=["q_proj"], modules_to_save=["lm_head"])
    streamed = _assert_streams_merge_and_unload(model)
    head = model.get_base_model().lm_head
    assert torch.equal(streamed["lm_head.weight"], head.modules_to_save["default"].weight)
    assert not torch.equal(streamed["lm_head.weight"], head.original_module.weight)


def test_two_adapters_only_the_active_one_is_merged(build_peft: BuildPeft) -> None:
    model = build_peft(
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
        extra_adapters={
            "second": {"r": 2, "lora_alpha": 3, "target_modules": ["v_proj", "up_proj"]}
        },
        active="second",
    )
    streamed = _assert_streams_merge_and_unload(model)
    # The first adapter's LoRA and trained lm_head are left out.
    first = copy.deepcopy(model)
    first.set_adapter("default")
    assert not torch.equal(
        streamed["model.layers.0.self_attn.v_proj.weight"],
        dict(DTensorRefitSource(first).iter_weights())["model.layers.0.self_attn.v_proj.weight"],
    )
    head = model.get_base_model().lm_head
    assert torch.equal(streamed["lm_head.weight"], head.original_module.weight)


def test_tied_embeddings_are_sent_once(build_peft: BuildPeft) -> None:
    model = build_peft(config={"tie_word_embeddings": True})
    streamed = _assert_streams_merge_and_unload(model, torch.bfloat16)
    assert "lm_head.weight" not in streamed
    assert "model.embed_tokens.weight" in streamed


def test_tied_embeddings_with_a_trained_head_send_both_as_merge_and_unload(
    build_peft: BuildPeft, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_peft(
        config={"tie_word_embeddings": True}, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    with caplog.at_level(logging.WARNING):
        streamed = _assert_streams_merge_and_unload(model)
    assert "tie_word_embeddings" in caplog.text  # the base source's broken-tie warning
    copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path)
    assert sorted(streamed) == sorted(load_file(str(tmp_path / "model.safetensors")))


def test_bias_all_sends_the_trained_biases(build_peft: BuildPeft) -> None:
    model = build_peft(config={"attention_bias": True}, bias="all")
    assert any(
        p.requires_grad for n, p in model.named_parameters() if n.endswith("q_proj.base_layer.bias")
    )
    with torch.no_grad():  # the biases were trained in place
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(1.0)
    streamed = _assert_streams_merge_and_unload(model)
    assert "model.layers.0.self_attn.q_proj.bias" in streamed


def test_bf16_trainer_with_fp32_adapters_rounds_as_peft(build_peft: BuildPeft) -> None:
    model = build_peft(dtype=torch.bfloat16)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    assert (layer.base_layer.weight.dtype, layer.lora_B["default"].weight.dtype) == (
        torch.bfloat16,
        torch.float32,
    )
    _assert_streams_merge_and_unload(model)
    _assert_streams_merge_and_unload(model, torch.float32)


def test_bf16_adapters_round_the_delta_as_peft(build_peft: BuildPeft) -> None:
    model = build_peft(dtype=torch.bfloat16)
    model = model.to(torch.bfloat16)
    assert model.get_base_model().model.layers[0].mlp.up_proj.lora_A["default"].weight.dtype == (
        torch.bfloat16
    )
    _assert_streams_merge_and_unload(model)


def test_fan_in_fan_out_conv1d_gpt2() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    base = GPT2LMHeadModel(config).eval()
    model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["c_attn", "c_fc"],
            fan_in_fan_out=True,
            init_lora_weights=False,
        ),
    )
    layer = model.get_base_model().transformer.h[0].attn.c_attn
    assert layer.fan_in_fan_out
    assert tuple(layer.base_layer.weight.shape) == (32, 96)  # Conv1D: [in, out]
    _assert_streams_merge_and_unload(model)


def test_compiled_trainer_is_unwrapped(build_peft: BuildPeft) -> None:
    model = build_peft()
    names, _ = _merged_reference(model)
    compiled = torch.compile(model)
    assert list(DTensorRefitSource(compiled).prepare_refit_info()) == names  # type: ignore[arg-type]
    _assert_streams_merge_and_unload(model)


def test_switching_the_active_adapter_after_building_is_refused(build_peft: BuildPeft) -> None:
    model = build_peft(extra_adapters={"second": {}})
    source = DTensorRefitSource(model)
    source.prepare_refit_info()
    model.set_adapter("second")
    with pytest.raises(RefitMismatchError, match="active adapter changed"):
        next(source.iter_weights())


def test_merging_in_place_after_building_is_refused(build_peft: BuildPeft) -> None:
    model = build_peft(target_modules=["q_proj"])
    source = DTensorRefitSource(model)
    model.merge_adapter()
    with pytest.raises(RefitMismatchError, match="merge_adapter"):
        list(source.iter_weights())


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_inits_that_rewrite_the_base_merge_as_peft(build_peft: BuildPeft, init: str) -> None:
    _assert_streams_merge_and_unload(build_peft(init_lora_weights=init, target_modules=["q_proj"]))
