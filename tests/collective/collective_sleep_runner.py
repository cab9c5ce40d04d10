"""A runner for the embedded engine's workers (``runner_factory=``) that loses its
non-persistent buffers on a level-2 sleep, as vLLM's level 2 frees all device memory."""

from __future__ import annotations

from typing import Any

import torch

from aiosync.engines.embedded.model import HFModelRunner


class BufferDroppingRunner(HFModelRunner):
    """:class:`HFModelRunner` whose discard (level-2 sleep) also zeroes the buffers the
    checkpoint does not carry (the rotary ``inv_freq``)."""

    def fill_(self, value: float) -> None:
        super().fill_(value)
        carried = set(self.expected_manifest())
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                if name not in carried:
                    buffer.zero_()


def make(model: Any, *, seed: int, dtype: str) -> BufferDroppingRunner:
    """The ``runner_factory`` entry point: the model of ``model`` (a config dict)."""
    return BufferDroppingRunner(HFModelRunner.from_config(model, seed=seed, dtype=dtype).model)
