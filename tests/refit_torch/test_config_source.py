"""The trainer's side of the config check: each refit source reports the HF config
its model computes with (``aiosync.sources.ConfigSource``), and a drift that keeps
the shapes (another ``rope_theta``, ``rms_norm_eps``) is refused against it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from aiosync._hf_config import compare_hf_configs
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.errors import RefitMismatchError
from aiosync.refit import DTensorRefitSource
from aiosync.sources import ConfigSource

transformers = pytest.importorskip("transformers")

#: A 2-layer Qwen3 that builds in well under a second (no downloads).
QWEN3: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN3.items() if k != "model_type"},
    "head_dim": 16,
}


def qwen3(**overrides: Any) -> Any:
    config = transformers.Qwen3Config(**(QWEN3 | overrides))
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


def test_the_torch_source_reports_its_models_config() -> None:
    model = qwen3(rope_theta=250000.0)
    source = DTensorRefitSource(model, dtype=torch.bfloat16)
    assert isinstance(source, ConfigSource)
    assert source.hf_config() is model.config
    assert source.hf_config().rope_parameters["rope_theta"] == 250000.0


def test_a_wrapped_model_reports_the_inner_models_config() -> None:
    model = qwen3()
    # torch.compile wraps without compiling until the first call.
    source = DTensorRefitSource(torch.compile(model))
    assert source.hf_config() is model.config


def test_a_module_without_an_hf_config_reports_none() -> None:
    class WithOtherConfig(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.config = {"not": "an HF config"}

    assert DTensorRefitSource(nn.Linear(4, 4)).hf_config() is None
    assert DTensorRefitSource(WithOtherConfig()).hf_config() is None


def test_another_rope_theta_is_refused_naming_both_values() -> None:
    source = DTensorRefitSource(qwen3())
    engine = qwen3(rope_theta=500000.0).config
    with pytest.raises(RefitMismatchError) as caught:
        compare_hf_configs(source.hf_config(), engine)
    message = str(caught.value)
    assert "in 1 field(s)" in message
    assert "rope_parameters.rope_theta: trainer 10000.0, engine 500000.0" in message


def test_another_rms_norm_eps_is_refused_and_the_same_config_passes() -> None:
    source = DTensorRefitSource(qwen3())
    with pytest.raises(RefitMismatchError, match=r"rms_norm_eps: trainer 1e-06, engine 1e-05"):
        compare_hf_configs(source.hf_config(), qwen3(rms_norm_eps=1e-5).config)
    # The same config, as the engine reads it back from config.json, passes.
    compare_hf_configs(source.hf_config(), qwen3().config.to_dict())
    # Fields that do not change what the weights compute may differ.
    compare_hf_configs(
        source.hf_config(), qwen3(use_cache=False, max_position_embeddings=64).config
    )


def test_a_peft_model_reports_its_base_models_config() -> None:
    peft = pytest.importorskip("peft")
    base = qwen3(rope_theta=123456.0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    merged = DTensorRefitSource(model)
    assert merged.hf_config() is base.config

    from aiosync.refit import LoRAAdapterRefitSource

    adapter = LoRAAdapterRefitSource(model)
    assert isinstance(adapter, ConfigSource)
    assert adapter.hf_config() is base.config
    with pytest.raises(RefitMismatchError, match=r"trainer 123456.0, engine 10000.0"):
        compare_hf_configs(adapter.hf_config(), qwen3().config)


def test_the_nnx_source_reports_the_config_its_map_was_built_from() -> None:
    pytest.importorskip("jax")
    from aiosync.refit.nnx import NNXRefitSource, model_map_for

    config = {"model_type": "qwen3", **QWEN3, "rope_theta": 250000.0}
    source = NNXRefitSource({}, model_map_for(config))
    assert isinstance(source, ConfigSource)
    assert source.hf_config() is config
    with pytest.raises(RefitMismatchError, match=r"trainer 250000.0, engine 10000.0"):
        compare_hf_configs(source.hf_config(), qwen3().config)
    # A map built by hand records no config: nothing to compare.
    from aiosync.refit.nnx import ModelMap

    assert NNXRefitSource({}, ModelMap("qwen3", [])).hf_config() is None
