"""The engine's side of the config check (``aiosync.capabilities.ConfigReporting``): the
embedded engine and the vLLM backend report the HF config they compute with, and an
engine built with another ``rope_theta`` or ``rms_norm_eps`` than the trainer's model
(same shapes, other tokens) is refused against the trainer's source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from aiosync._hf_config import compare_hf_configs
from aiosync.capabilities import ConfigReporting
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import RefitMismatchError
from aiosync.refit import DTensorRefitSource

transformers = pytest.importorskip("transformers")


def trainer_source(config: dict[str, Any] = TINY_QWEN3) -> DTensorRefitSource:
    """The trainer's source over a real model built as the engine builds its own."""
    items = dict(config)
    hf_config = transformers.AutoConfig.for_model(items.pop("model_type"), **items)
    torch.manual_seed(0)
    return DTensorRefitSource(transformers.AutoModelForCausalLM.from_config(hf_config))


async def test_the_engine_reports_the_config_its_workers_build() -> None:
    engine = EmbeddedEngine({**TINY_QWEN3, "rope_theta": 500000.0})
    assert isinstance(engine, ConfigReporting)
    config = await engine.expected_config()
    assert isinstance(config, transformers.Qwen3Config)
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert config.hidden_size == TINY_QWEN3["hidden_size"]
    # Built once: the same object on every call.
    assert await engine.expected_config() is config


async def test_an_engine_with_another_rope_theta_is_refused_naming_both_values() -> None:
    engine = EmbeddedEngine({**TINY_QWEN3, "rope_theta": 500000.0})
    with pytest.raises(RefitMismatchError) as caught:
        compare_hf_configs(trainer_source().hf_config(), await engine.expected_config())
    message = str(caught.value)
    assert "in 1 field(s)" in message
    assert "rope_parameters.rope_theta: trainer 10000.0, engine 500000.0" in message


async def test_an_engine_with_another_rms_norm_eps_is_refused() -> None:
    engine = EmbeddedEngine({**TINY_QWEN3, "rms_norm_eps": 1e-5})
    with pytest.raises(RefitMismatchError, match=r"rms_norm_eps: trainer 1e-06, engine 1e-05"):
        compare_hf_configs(trainer_source().hf_config(), await engine.expected_config())


async def test_the_same_config_and_allowed_differences_pass() -> None:
    trainer = trainer_source().hf_config()
    compare_hf_configs(trainer, await EmbeddedEngine(TINY_QWEN3).expected_config())
    # The engine's dtype and bookkeeping differ from the trainer's; that is allowed.
    allowed = {**TINY_QWEN3, "use_cache": False, "max_position_embeddings": 64}
    compare_hf_configs(trainer, await EmbeddedEngine(allowed, dtype="bfloat16").expected_config())


async def test_an_engine_built_from_a_config_file_or_folder_reports_its_contents(
    tmp_path: Path,
) -> None:
    source = trainer_source()
    folder = tmp_path / "model"
    source.hf_config().save_pretrained(folder)
    compare_hf_configs(source.hf_config(), await EmbeddedEngine(folder).expected_config())
    drifted = json.loads((folder / "config.json").read_text())
    drifted["rope_parameters"]["rope_theta"] = 20000.0
    path = tmp_path / "drifted.json"
    path.write_text(json.dumps(drifted))
    with pytest.raises(RefitMismatchError, match=r"trainer 10000.0, engine 20000.0"):
        compare_hf_configs(source.hf_config(), await EmbeddedEngine(path).expected_config())


async def test_an_engine_with_its_own_runner_reports_no_config() -> None:
    # A weights-only runner need not compute what the config says: nothing to compare.
    engine = EmbeddedEngine(TINY_QWEN3, runner_factory="benchmarks.ipc.FlatModel")
    assert await engine.expected_config() is None


# -- vLLM: no vLLM here, so a stand-in for the object path vLLM keeps its config on ---


class _ModelConfig:
    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self.enable_sleep_mode = False


class _VllmConfig:
    def __init__(self, hf_config: Any) -> None:
        self.model_config = _ModelConfig(hf_config)


class _LLMEngine:
    def __init__(self, hf_config: Any) -> None:
        self.vllm_config = _VllmConfig(hf_config)


class StandInLLM:
    """What ``VLLMGenerationBackend`` reads of a ``vllm.LLM`` here: its (synchronous)
    ``collective_rpc`` and ``llm_engine.vllm_config.model_config.hf_config``."""

    def __init__(self, hf_config: Any) -> None:
        self.llm_engine = _LLMEngine(hf_config)

    def collective_rpc(self, method: str, **kwargs: Any) -> list[Any]:
        raise AssertionError("the config is read without an RPC")


class StandInAsyncLLM:
    """``AsyncLLM`` keeps ``vllm_config`` on itself; its ``collective_rpc`` is a coroutine."""

    def __init__(self, hf_config: Any) -> None:
        self.vllm_config = _VllmConfig(hf_config)

    async def collective_rpc(self, method: str, **kwargs: Any) -> list[Any]:
        raise AssertionError("the config is read without an RPC")


@pytest.mark.parametrize("kind", [StandInLLM, StandInAsyncLLM])
async def test_the_vllm_backend_reports_vllms_hf_config(kind: type) -> None:
    from aiosync.engines.vllm.backend import VLLMGenerationBackend

    items = {k: v for k, v in TINY_QWEN3.items() if k != "model_type"}
    drifted = transformers.Qwen3Config(**items, rope_theta=500000.0)
    backend = VLLMGenerationBackend(kind(drifted))
    assert isinstance(backend, ConfigReporting)
    assert await backend.expected_config() is drifted
    with pytest.raises(RefitMismatchError, match=r"trainer 10000.0, engine 500000.0"):
        compare_hf_configs(trainer_source().hf_config(), await backend.expected_config())
    assert await VLLMGenerationBackend(kind(None)).expected_config() is None
