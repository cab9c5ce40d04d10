"""Adapter-only refits: a real PEFT LoRA trainer in this process, real engines in others.

The trainer's base model is the engine's own (same tiny Qwen3 config, same
seed, fp32), wrapped with ``peft.get_peft_model``; ``init_lora_weights=False``
gives ``lora_B`` random nonzero values (PEFT's default zeros would make the
adapter a no-op, and a test comparing outputs unable to fail). What the engine
must generate after a sync is what ``copy.deepcopy(peft_model).merge_and_unload()``
generates here, greedily, token for token.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import LoRAAdapterRefitSource

#: The engines' (and so the trainer's base model's) config and seed.
CONFIG: dict[str, Any] = TINY_QWEN3
ENGINE_SEED = 5
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9], [10, 11]]
NEW_TOKENS = 8
#: Bytes of the tiny Qwen3's r=4 adapter on all 7 linear layers of its 2 blocks, fp32:
#: per block q (4x64 + 128x4), k and v (4x64 + 64x4 each), o (4x128 + 64x4),
#: gate and up (4x64 + 128x4 each), down (4x128 + 64x4) = 4864 parameters.
ADAPTER_NBYTES = 2 * 4864 * 4
#: Every linear layer of a Qwen3 block.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_engine(num_workers: int) -> EmbeddedEngine:
    """An embedded engine of the tests' base model (:data:`CONFIG`, :data:`ENGINE_SEED`,
    fp32) with ``num_workers`` workers and a 120 s RPC limit."""
    return EmbeddedEngine(
        CONFIG, num_workers=num_workers, seed=ENGINE_SEED, dtype="float32", rpc_timeout_s=120
    )


class LoRATrainer:
    """A PEFT LoRA trainer on the engines' base model, with an "optimizer step"."""

    def __init__(
        self, *, r: int = 4, targets: Sequence[str] = TARGETS, config: dict[str, Any] = CONFIG
    ) -> None:
        base = HFModelRunner.from_config(config, seed=ENGINE_SEED).model
        lora = LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            self.model: PeftModel = get_peft_model(base, lora)  # type: ignore[assignment]
        self.model.eval()
        self.source = LoRAAdapterRefitSource(self.model)

    def step(self, seed: int) -> None:
        """Perturb every adapter parameter deterministically (the base stays frozen)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.5)

    def adapter_nbytes(self) -> int:
        """Bytes of the adapter's tensors, as PEFT saves them."""
        state = get_peft_model_state_dict(self.model)
        return sum(t.numel() * t.element_size() for t in state.values())

    def merged_generate(
        self, prompts: Sequence[Sequence[int]] = PROMPTS, n: int = NEW_TOKENS
    ) -> list[list[int]]:
        """Greedy generation of ``copy.deepcopy(peft_model).merge_and_unload()``."""
        merged = copy.deepcopy(self.model).merge_and_unload()
        return HFModelRunner(merged).generate([list(p) for p in prompts], max_new_tokens=n)


def base_generate(
    prompts: Sequence[Sequence[int]] = PROMPTS, n: int = NEW_TOKENS
) -> list[list[int]]:
    """Greedy generation of the base model alone."""
    runner = HFModelRunner.from_config(CONFIG, seed=ENGINE_SEED)
    return runner.generate([list(p) for p in prompts], max_new_tokens=n)


def lora_server(folder: Path, *extra: str) -> Iterator[Any]:
    """A real SGLang-contract server process on 127.0.0.1 (``tests/http/conftest.py``'s
    ``TestServer``) of the tests' base model (:data:`CONFIG`, :data:`ENGINE_SEED`, fp32),
    its files under ``folder``, with the flags ``extra``; closed after."""
    config = folder / "config.json"
    config.write_text(json.dumps(CONFIG))
    args = ("--dtype", "float32", "--seed", str(ENGINE_SEED), *extra)
    server = load_http_conftest().TestServer(folder, config, *args)
    try:
        yield server
    finally:
        server.close()


def load_http_conftest() -> ModuleType:
    """``tests/http/conftest.py`` by path (pytest's importlib mode keeps it off sys.path),
    for its ``TestServer`` (a real SGLang-contract server process on 127.0.0.1)."""
    path = Path(__file__).resolve().parents[1] / "http" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_lora_http_conftest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
