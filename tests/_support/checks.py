"""Assertions several folders share."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assert_engine_equals"]


async def assert_engine_equals(engine: Any, trainer: Any) -> None:
    """Every worker of ``engine`` holds the trainer's checkpoint tensors
    (``trainer.hf_state_dict()``): the same names in the same order, bit for bit."""
    expected = trainer.hf_state_dict()
    for rank, state in enumerate(await engine.hf_state_dicts()):
        assert list(state) == list(expected), f"worker {rank} names differ"
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), f"worker {rank}: {name} differs"
