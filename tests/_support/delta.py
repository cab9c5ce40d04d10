"""The delta tests' trainer and checks, once: a bf16 tiny Qwen3 taking AdamW steps, the bytes
its changed bits should move, and whether every worker holds it bit for bit."""

from __future__ import annotations

from typing import Any

import torch

from aiosync import VersionEventKind
from aiosync.delta import encode_patch
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner

__all__ = [
    "DeltaTrainer",
    "bits",
    "box_patch_bytes",
    "committed",
    "holds",
    "patch_bytes",
    "refused_without_base",
]


class DeltaTrainer:
    """A bf16 tiny Qwen3 and its AdamW: ``step()`` is one optimizer step."""

    def __init__(self, seed: int, lr: float) -> None:
        self.runner = HFModelRunner.from_config(TINY_QWEN3, seed=seed, dtype=torch.bfloat16)
        self.model = self.runner.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        batch = torch.randint(0, 128, (2, 8), generator=self.gen)
        self.model(batch, labels=batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.runner.hf_state_dict().items()}

    def full_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits, flat (bf16 as int16, float32 as int32)."""
    return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def patch_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """Bytes of the smallest encoding of every changed tensor (the expected delta)."""
    patches = (encode_patch(n, 0, bits(old[n]), new[n]) for n in new)
    return sum(p.nbytes for p in patches if p is not None)


async def holds(generation: Any, want: dict[str, torch.Tensor]) -> bool:
    """Whether every worker of ``generation`` holds ``want`` bit for bit."""
    return all(
        torch.equal(bits(state[n]), bits(t))
        for state in await generation.hf_state_dicts()
        for n, t in want.items()
    )


async def committed(sync: Any, events: Any) -> tuple[bool, int]:
    """Mark stale, sync, and return the COMMITTED event's ``(delta, nbytes)``."""
    await sync.mark_stale()
    await sync.sync_weights()
    while True:
        event = await events.__anext__()
        if event.kind is VersionEventKind.COMMITTED:
            return event.delta, event.nbytes


def box_patch_bytes(plan: Any, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """Bytes a sharded delta should move: per transfer of ``plan`` (one box of one full
    tensor), nothing when no bit of the box changed, else the smaller of its dense bytes
    and int32 indices + values of its changed elements (ties dense)."""
    total = 0
    for t in plan.transfers():
        index = tuple(slice(lo, hi) for lo, hi in t.box)
        before, after = old[t.name][index], new[t.name][index]
        changed = int((bits(before.contiguous()) != bits(after.contiguous())).sum())
        if changed:
            size = after.element_size()
            total += min(after.numel() * size, changed * (4 + size))
    return total


async def refused_without_base(sync: Any, trainer: Any, engine: Any, discarded: Any) -> None:
    """The trainer steps and ``sync`` sends a delta to workers whose weights were
    discarded (``discarded``: each worker's state then), its check of their held versions
    skipped: every worker refuses it, naming both versions, and writes nothing."""
    import pytest

    from aiosync.errors import RefitMismatchError

    trainer.step()
    await sync.mark_stale()
    with pytest.raises(RefitMismatchError, match="holds version None, the delta patches"):
        await sync.sync_weights()
    after = await engine.hf_state_dicts()
    pairs = zip(discarded, after, strict=True)
    assert all(torch.equal(a[n], b[n]) for a, b in pairs for n in a)
