"""Small model configs the tests build their trainers and engines from."""

from __future__ import annotations

from typing import Any

from aiosync.engines.embedded.configs import TINY_QWEN3

__all__ = ["DRAFT", "SMALL_QWEN3"]

#: A two-layer Qwen3 (``Qwen3Config(**SMALL_QWEN3)``): the target model of the draft
#: tests and the model of the config-drift tests.
SMALL_QWEN3: dict[str, Any] = {
    k: v for k, v in TINY_QWEN3.items() if k not in ("model_type", "tie_word_embeddings")
}
#: A one-layer model as the draft (the stand-in of an MTP module or an EAGLE head).
DRAFT: dict[str, Any] = dict(SMALL_QWEN3, num_hidden_layers=1, intermediate_size=96)
