"""``aiosync.refit.share_parameters``: a module's tensors re-homed into one named
shared-memory arena, in place (the same ``Parameter`` objects, ties kept, AdamW unaffected),
and the arena's name gone after ``close()``, after a normal exit and, for a SIGKILLed
creator, after the next sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from aiosync import share_parameters
from aiosync._arena import locate
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.transports._leftovers import SHM_DIR, sweep_leftovers


def _train(model: nn.Module, steps: int, seed: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 5), generator=generator)
        loss = model(input_ids=x).logits.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_parameters_move_in_place_and_train_as_before() -> None:
    shared_model = HFModelRunner.from_config(dict(TINY_QWEN3), seed=5).model
    plain_model = HFModelRunner.from_config(dict(TINY_QWEN3), seed=5).model
    before = {n: p for n, p in shared_model.named_parameters()}
    with share_parameters(shared_model) as shared:
        assert os.path.exists(os.path.join(SHM_DIR, shared.name))
        # The same Parameter objects, now in the arena, with the same values.
        assert {n: p for n, p in shared_model.named_parameters()} == before
        for name, p in shared_model.named_parameters():
            where = locate(p.detach())
            assert where is not None and where[0].name == shared.name, name
            assert torch.equal(p, dict(plain_model.named_parameters())[name])
        # AdamW steps (the optimizer built after) write into the arena, bit-exact
        # with the same steps on a private model.
        _train(shared_model, steps=3, seed=1)
        _train(plain_model, steps=3, seed=1)
        for name, p in shared_model.named_parameters():
            assert locate(p.detach()) is not None, name
            assert torch.equal(p, dict(plain_model.named_parameters())[name]), name
    assert not os.path.exists(os.path.join(SHM_DIR, shared.name))
    # After close the tensors are still the model's (the mapping lives), now packed.
    assert locate(next(shared_model.parameters()).detach()) is None
    _train(shared_model, steps=1, seed=2)


def test_tied_parameters_stay_tied_and_buffers_move() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.BatchNorm1d(10))
    model[1].weight = model[0].weight
    with share_parameters(model) as shared:
        assert model[1].weight is model[0].weight
        assert locate(model[0].weight.detach()) is not None
        assert locate(model[2].running_mean) is not None  # a persistent buffer
        # embedding + batchnorm weight, bias; running_mean, running_var, num_batches_tracked
        assert shared.tensors == 6


def test_only_dense_cpu_or_cuda_tensors_are_shared() -> None:
    with pytest.raises(TypeError, match="CPU or CUDA tensors: 'weight' is on meta"):
        share_parameters(nn.Linear(2, 2, bias=False, device="meta"))
    with pytest.raises(ValueError, match="no parameters"):
        share_parameters(nn.ReLU())
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module, got Tensor"):
        share_parameters(torch.ones(3))  # type: ignore[arg-type]
    sparse = nn.Module()
    sparse.p = nn.Parameter(torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match=r"'p' is torch\.sparse_coo"):
        share_parameters(sparse)


def test_the_embedded_runner_reads_and_writes_the_shared_tensors() -> None:
    # HFModelRunner resolved its tensors before they moved: it follows them.
    runner = HFModelRunner.from_config(dict(TINY_QWEN3), seed=6)
    with share_parameters(runner.model):
        with torch.no_grad():
            for p in runner.model.parameters():
                p.mul_(0.5)
        live = dict(DTensorRefitSource(runner.model).iter_weights())
        assert {n: torch.equal(t, live[n]) for n, t in runner.hf_state_dict().items()} == {
            n: True for n in live
        }
        assert runner.load_weights([("model.norm.weight", torch.full((64,), 7.0))]) == 1
        assert torch.equal(
            runner.model.get_parameter("model.norm.weight").detach(), torch.full((64,), 7.0)
        )


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from aiosync import share_parameters
    shared = share_parameters(torch.nn.Linear(8, 8))
    print(shared.name, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_the_name_is_gone_after_exit_and_after_a_sigkill_and_sweep(end: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, end], capture_output=True, text=True, timeout=120
    )
    name = child.stdout.strip()
    assert name.startswith("aiosync-params-"), child.stderr
    path = os.path.join(SHM_DIR, name)
    if end == "exit":
        assert child.returncode == 0, child.stderr
        assert not os.path.exists(path)  # unlinked at interpreter exit
    else:
        assert child.returncode == -signal.SIGKILL
        assert os.path.exists(path)  # no clean-up ran
        assert path in sweep_leftovers()
        assert not os.path.exists(path)
