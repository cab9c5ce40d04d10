"""aiosync's refit source seen through vLLM's own weight-transfer contract
(``vllm.distributed.weight_transfer.WeightSource``). The NCCL/IPC backends
themselves need CUDA: see docs/hardware-deferred-validation.md."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm.distributed.weight_transfer.base import layerwise_groups

from aiosync.refit import DTensorRefitSource
from aiosync.transports.vllm_weight_transfer import (
    refit_weight_source,
    vllm_weight_transfer_available,
)

pytestmark = pytest.mark.vllm


def test_installed_vllm_has_the_weight_transfer_api() -> None:
    assert vllm_weight_transfer_available() is True


def test_refit_source_satisfies_vllms_weight_source_order_and_metadata(trainer: Any) -> None:
    policy = DTensorRefitSource(trainer)
    manifest = policy.prepare_refit_info()
    source = refit_weight_source(policy)
    meta = source.metadata()
    assert [m.name for m in meta] == list(manifest)
    assert [(m.shape, m.dtype) for m in meta] == [
        (tuple(shape), dtype) for shape, dtype in manifest.values()
    ]
    expected = dict(policy.iter_weights())
    for _ in range(2):  # every round is a fresh pass
        groups = list(source.iter_groups())  # vLLM checks the order against metadata()
        assert [names for names, _ in groups] == layerwise_groups(list(manifest))
        for names, tensors in groups:
            for name, tensor in zip(names, tensors, strict=True):
                assert torch.equal(tensor, expected[name]), name
