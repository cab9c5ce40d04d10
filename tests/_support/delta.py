"""The delta tests' trainer and checks, once: a bf16 tiny Qwen3 taking AdamW steps, the bytes
its changed bits should move, and whether every worker holds it bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiosync import VersionEventKind
from aiosync.delta import encode_patch
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner

__all__ = [
    "CORRUPTED",
    "DeltaTrainer",
    "bits",
    "box_patch_bytes",
    "committed",
    "corrupt_check_and_heal",
    "holds",
    "patch_bytes",
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


#: The live weight :func:`corrupt_check_and_heal` corrupts (one element, on every worker).
CORRUPTED = "model.layers.1.mlp.down_proj.weight"


async def corrupt_check_and_heal(
    sync: Any, events: Any, engine: Any, trainer: DeltaTrainer
) -> None:
    """After a delta sync, one element of a live engine weight becomes 1e37 behind the
    transport's back: ``verify_engine()`` names it and makes the synchronizer stale, and
    the next sync (a delta synchronizer's) is full and leaves every worker bit-identical
    to the trainer; the sync after it is a delta again."""
    from aiosync import RefitVerificationError
    from aiosync.engines.embedded._worker import tensor_to_wire

    await committed(sync, events)  # full: the baseline
    trainer.step()
    assert (await committed(sync, events))[0] is True
    await sync.verify_engine()  # the delta landed intact
    bad = trainer.state()[CORRUPTED]
    bad.view(-1)[17] = 1e37
    await engine.collective_rpc("embedded_load_state_dict", ({CORRUPTED: tensor_to_wire(bad)},))
    assert not sync.is_stale
    version = sync.weight_version
    with pytest.raises(
        RefitVerificationError, match=rf"engine worker 0: {CORRUPTED} differs from the trainer's"
    ):
        await sync.verify_engine()
    assert (sync.is_stale, sync.weight_version) == (True, version)
    trainer.step()
    delta, nbytes = await committed(sync, events)
    assert (delta, nbytes) == (False, trainer.full_bytes())
    assert await holds(engine, trainer.state())
    await sync.verify_engine()
    trainer.step()
    assert (await committed(sync, events))[0] is True  # the baseline is whole again
    assert await holds(engine, trainer.state())
