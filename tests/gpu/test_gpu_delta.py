"""Delta patches with CUDA tensors on both ends: the trainer's tensor on the GPU is diffed
against its host baseline, and each patch lands in a CUDA weight (whole, and a TP=2 slice
along either dim) bit for bit. The same check runs on CPU tensors, so the harness is known to
work before a GPU is lent."""

from __future__ import annotations

import pytest
import torch

from aiosync.delta import DeltaBaseline, apply_patch
from aiosync.layout import Part

SHAPES = {"q_proj.weight": (256, 128), "o_proj.weight": (128, 256), "norm.weight": (128,)}


def _check(device: torch.device) -> dict[str, tuple[str, bool]]:
    gen = torch.Generator().manual_seed(3)
    old = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    baseline = DeltaBaseline()
    list(baseline.stage_full(1, ((n, t.to(device)) for n, t in old.items())))
    baseline.commit()
    new = {n: t.clone() for n, t in old.items()}
    new["q_proj.weight"].view(-1)[::97] += 1.0  # a few elements: indices
    new["o_proj.weight"].view(torch.int16)[:, ::3] ^= 1  # a third: a bitmap
    new["norm.weight"] *= 2  # all: dense
    patches = {p.name: p for p in baseline.diff((n, t.to(device)) for n, t in new.items())}
    seen = {}
    for name, shape in SHAPES.items():
        parts = [Part.whole(shape)]
        if len(shape) == 2:
            dim = 0 if name.startswith("q") else 1
            half = shape[dim] // 2
            parts += [Part(shape, dim, 0, half), Part(shape, dim, half, half)]
        ok = True
        for part in parts:
            live = old[name].narrow(part.dim, part.start, part.length).contiguous().to(device)
            apply_patch(live, part, patches[name])
            want = new[name].narrow(part.dim, part.start, part.length)
            ok = ok and torch.equal(live.cpu().view(torch.int16), want.view(torch.int16))
        seen[name] = (patches[name].encoding, ok)
    return seen


EXPECTED = {
    "q_proj.weight": ("indices", True),
    "o_proj.weight": ("bitmap", True),
    "norm.weight": ("dense", True),
}


@pytest.mark.gpu
def test_patches_from_and_into_cuda_tensors_are_bit_exact() -> None:
    assert _check(torch.device("cuda", 0)) == EXPECTED


def test_the_same_check_on_cpu_tensors() -> None:
    assert _check(torch.device("cpu")) == EXPECTED
