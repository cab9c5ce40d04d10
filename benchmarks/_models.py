"""Model configs the benchmarks share (a sibling module: ``from _models import ...``)."""

from __future__ import annotations

from typing import Any

from aiosync.engines.embedded.configs import TINY_QWEN3

#: A Qwen3 (~20 M parameters) big enough that one refit takes a visible fraction of a
#: second on a CPU.
SMALL_QWEN3: dict[str, Any] = {
    **TINY_QWEN3,
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
