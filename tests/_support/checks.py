"""Assertions several folders share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aiosync.capabilities import (
    DiscardNotifier,
    Engine,
    EngineWorkers,
    Generating,
    PausableEngine,
    SleepReporting,
    VersionedEngine,
)

__all__ = [
    "ENGINE_CAPABILITIES",
    "assert_engine_equals",
    "assert_stream_matches",
    "full_forward_logprobs",
    "refuses_kv_scales",
]

#: The capabilities every engine in front of a real one claims (the embedded engine,
#: an engine fleet, a Ray engine), in the order the tests list them.
ENGINE_CAPABILITIES: tuple[type, ...] = (
    Engine,
    PausableEngine,
    VersionedEngine,
    DiscardNotifier,
    SleepReporting,
    EngineWorkers,
    Generating,
)


async def assert_engine_equals(engine: Any, trainer: Any) -> None:
    """Every worker of ``engine`` holds the trainer's checkpoint tensors
    (``trainer.hf_state_dict()``): the same names in the same order, bit for bit."""
    expected = trainer.hf_state_dict()
    for rank, state in enumerate(await engine.hf_state_dicts()):
        assert list(state) == list(expected), f"worker {rank} names differ"
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), f"worker {rank}: {name} differs"


def full_forward_logprobs(
    model: Any, prompt: Sequence[int], tokens: Sequence[int]
) -> tuple[list[float], list[int]]:
    """``(log_softmax of each token, argmax at each position)``, one forward pass of the
    transformers ``model`` over ``prompt + tokens``: what an engine's logprobs must be."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    logp = torch.log_softmax(logits, dim=-1)
    return (
        [float(logp[p, t]) for p, t in zip(positions, tokens, strict=True)],
        [int(torch.argmax(logits[p])) for p in positions],
    )


async def refuses_kv_scales(
    sync: Any, cases: Sequence[tuple[Any, type[Exception], str]], versions: tuple[int, int, bool]
) -> None:
    """``sync.sync_weights(kv_scales=bad)`` raises each case's ``(bad, error type,
    message regex)`` and leaves ``(policy_version, weight_version, is_stale)`` at
    ``versions`` (nothing starts: no event, no byte)."""
    import pytest

    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            await sync.sync_weights(kv_scales=bad)
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == versions


def assert_stream_matches(
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
) -> None:
    """Every entry of a streamed manifest (``meta["manifest"]``: name, shape, dtype name)
    and its tensor are ``reference``'s (cast to ``dtype`` where given), bit for bit."""
    for name, shape, dtype_name in meta["manifest"]:
        expected = reference[name] if dtype is None else reference[name].to(dtype)
        assert tuple(shape) == tuple(expected.shape), name
        assert dtype_name == str(expected.dtype).removeprefix("torch."), name
        assert tensors[name].dtype == expected.dtype, name
        assert torch.equal(tensors[name], expected), name
