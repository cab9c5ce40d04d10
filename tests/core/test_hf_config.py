"""Config drift that keeps the shapes is refused with the fields named."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from aiosync import RefitMismatchError
from aiosync._hf_config import compare_hf_configs, config_fields
from tests._support.configs import SMALL_QWEN3

SMALL = SMALL_QWEN3


def test_the_same_config_passes_and_bookkeeping_may_differ() -> None:
    trainer = Qwen3Config(**SMALL)
    engine = Qwen3Config(**SMALL, eos_token_id=7, use_cache=False, dtype="bfloat16")
    compare_hf_configs(trainer, engine)
    compare_hf_configs(trainer, engine.to_dict())  # a config.json as the server reads it


def test_rope_theta_and_rms_norm_eps_drift_is_named_with_both_values() -> None:
    trainer = Qwen3Config(**SMALL)
    engine = Qwen3Config(**SMALL, rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6})
    with pytest.raises(RefitMismatchError) as info:
        compare_hf_configs(trainer, engine, where="engine 0")
    message = str(info.value)
    assert "the model config of engine 0 differs from the trainer's in 2 field(s)" in message
    assert "rms_norm_eps: trainer 1e-06, engine 1e-05" in message
    assert "rope_parameters.rope_theta: trainer 10000.0, engine 1000000.0" in message


def test_an_older_config_json_spelling_of_rope_compares_equal() -> None:
    trainer = Qwen3Config(**SMALL, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    legacy = {**Qwen3Config(**SMALL).to_dict(), "rope_theta": 5e5}
    del legacy["rope_parameters"]
    assert config_fields(legacy)["rope_parameters.rope_theta"] == 5e5
    compare_hf_configs(trainer, legacy)
    legacy["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    with pytest.raises(RefitMismatchError, match=r"rope_parameters\.rope_type: trainer 'default'"):
        compare_hf_configs(trainer, legacy)


def test_moe_routing_fields_are_compared_and_an_allowance_skips_one() -> None:
    moe = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    trainer = Qwen3MoeConfig(**moe)
    engine = Qwen3MoeConfig(**{**moe, "num_experts_per_tok": 1})
    with pytest.raises(RefitMismatchError, match="num_experts_per_tok: trainer 2, engine 1"):
        compare_hf_configs(trainer, engine)
    compare_hf_configs(trainer, engine, may_differ={"num_experts_per_tok"})


def test_something_that_is_not_a_config_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="an HF config or its dict"):
        compare_hf_configs(object(), {})
