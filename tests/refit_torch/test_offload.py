"""Colocated offload hooks: the optimizer's state leaves the device and comes back intact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from aiosync.refit import DTensorRefitSource

BuildModel = Callable[..., nn.Module]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 8), generator=g, device=next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _state_snapshot(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
        for s in optimizer.state.values()
    ]


def _run_offload_round_trip(build_model: BuildModel, device: str) -> None:
    model = build_model("qwen3").to(device).train()
    reference = build_model("qwen3").to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    _train_step(model, opt, seed=0)
    _train_step(reference, ref_opt, seed=0)
    before = _state_snapshot(opt)
    devices = [{k: v.device for k, v in s.items()} for s in before]
    assert before and all("exp_avg" in s for s in before)

    source = DTensorRefitSource(model, optimizer=opt)
    source.offload_before_refit()
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device.type == "cpu"
    streamed = dict(source.iter_weights())  # the refit runs while the state is off the device
    assert torch.equal(streamed["model.norm.weight"], model.model.norm.weight)
    source.offload_after_refit()
    source.offload_after_refit()  # idempotent

    after = _state_snapshot(opt)
    assert [{k: v.device for k, v in s.items()} for s in after] == devices
    for b, a in zip(before, after, strict=True):
        assert b.keys() == a.keys()
        for key in b:
            assert torch.equal(b[key], a[key]), key

    # The optimizer keeps training exactly as one that was never offloaded.
    _train_step(model, opt, seed=1)
    _train_step(reference, ref_opt, seed=1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_optimizer_state_round_trip_is_exact_on_cpu(build_model: BuildModel) -> None:
    """On CPU the state is already off the device: the hooks move nothing and change nothing."""
    _run_offload_round_trip(build_model, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_optimizer_state_moves_to_cpu_and_back_on_cuda(build_model: BuildModel) -> None:
    _run_offload_round_trip(build_model, "cuda")


def test_hooks_without_optimizer_are_no_ops(build_model: BuildModel) -> None:
    source = DTensorRefitSource(build_model("qwen3"))
    source.offload_before_refit()
    source.offload_after_refit()
    assert len(source.prepare_refit_info()) == 25  # 2 layers x 11, embed, norm, lm_head
