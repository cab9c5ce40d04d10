"""A trainer's real refit source with a hook before each tensor (fault injection)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from aiosync import RefitSource
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest

__all__ = ["HookedSource", "hooked_trainer"]


class HookedSource(RefitSource):
    """``DTensorRefitSource(model)``; ``on_tensor(i)`` runs before the ``i``-th tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = DTensorRefitSource(model)
        self.on_tensor: Callable[[int], None] = lambda i: None

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner.iter_weights()):
            self.on_tensor(i)
            yield item


def hooked_trainer(seed: int) -> tuple[Any, HookedSource]:
    """The tiny Qwen3 (fp32, ``seed``) as a trainer, and a :class:`HookedSource` of it."""
    from aiosync.engines.embedded.configs import TINY_QWEN3
    from aiosync.engines.embedded.model import HFModelRunner

    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=seed)
    return trainer, HookedSource(trainer.model)
