"""Small model configs the tests build their trainers and engines from."""

from __future__ import annotations

from typing import Any

__all__ = ["DRAFT", "SMALL_QWEN3"]

#: A two-layer Qwen3 (``Qwen3Config(**SMALL_QWEN3)``): the target model of the draft
#: tests and the model of the config-drift tests.
SMALL_QWEN3: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
#: A one-layer model as the draft (the stand-in of an MTP module or an EAGLE head).
DRAFT: dict[str, Any] = dict(SMALL_QWEN3, num_hidden_layers=1, intermediate_size=96)
