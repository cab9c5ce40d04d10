"""One rank of the 2-process gloo tests: shard tiny models, stream them, save what came out.

Run as ``python _dist_worker.py RANK WORLD_SIZE PORT OUT_DIR`` (the test spawns
both ranks). For each case it writes ``OUT_DIR/{case}.rank{r}.safetensors``
(the streamed tensors) and ``.json`` (the manifest and the streamed order);
the test compares them with ``save_pretrained`` of the unsharded model.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).parent))
from _refit_torch_models import build_model

from aiosync.refit import DTensorRefitSource


def _fsdp2(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _placements(p: torch.Tensor, i: int) -> list[Placement]:
    """Every kind of placement across the model: Shard on each dim, Replicate."""
    choices: list[Placement] = [Replicate(), *(Shard(d) for d in range(p.dim()))]
    return [choices[i % len(choices)]]


def _dtensor(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Replace every parameter with a DTensor; tied parameters stay one object."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in memo:
                dt = distribute_tensor(p.detach(), mesh, _placements(p, len(memo)))
                memo[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            setattr(module, name, memo[id(p)])
    return model


def _save(out: Path, case: str, rank: int, source: DTensorRefitSource, into: bool = False) -> None:
    """Stream ``source`` and save it; ``into``: through ``iter_weights_into``, offering a
    new tensor of the manifest's shape and dtype for each name, but of the wrong dtype
    (float64) for every third, and record the names whose yielded tensor is the offer."""
    manifest = source.prepare_refit_info()
    order: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    offers: dict[str, torch.Tensor] = {}

    def destination(name: str) -> torch.Tensor:
        shape, dtype = manifest[name]
        wrong = list(manifest).index(name) % 3 == 2
        offers[name] = torch.full(shape, -1.0, dtype=torch.float64 if wrong else dtype)
        return offers[name]

    stream = source.iter_weights_into(destination) if into else source.iter_weights()
    gathered_into: list[str] = []
    for name, tensor in stream:
        order.append(name)
        assert not hasattr(tensor, "placements"), f"{name} is still a DTensor"
        if name in offers and tensor.data_ptr() == offers[name].data_ptr():
            gathered_into.append(name)
        tensors[name] = tensor.contiguous().clone()
    save_file(tensors, str(out / f"{case}.rank{rank}.safetensors"))
    meta = {
        "manifest": [[n, list(s), str(d).removeprefix("torch.")] for n, (s, d) in manifest.items()],
        "order": order,
        "offered": list(offers),
        "gathered_into": gathered_into,
    }
    (out / f"{case}.rank{rank}.json").write_text(json.dumps(meta))


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    cases: dict[str, Callable[[], DTensorRefitSource]] = {
        "fsdp2_qwen3_tied": lambda: DTensorRefitSource(_fsdp2(build_model("qwen3_tied"), mesh)),
        "fsdp2_qwen3_moe_bf16": lambda: DTensorRefitSource(
            _fsdp2(build_model("qwen3_moe"), mesh), dtype=torch.bfloat16
        ),
        "fsdp2_compiled_qwen3": lambda: DTensorRefitSource(
            torch.compile(_fsdp2(build_model("qwen3"), mesh))  # type: ignore[arg-type]
        ),
        "fsdp2_qwen3_next_bf16": lambda: DTensorRefitSource(
            _fsdp2(build_model("qwen3_next"), mesh), dtype=torch.bfloat16
        ),
        "dtensor_qwen3_tied": lambda: DTensorRefitSource(_dtensor(build_model("qwen3_tied"), mesh)),
        "dtensor_qwen3_moe": lambda: DTensorRefitSource(_dtensor(build_model("qwen3_moe"), mesh)),
    }
    for case, make in cases.items():
        _save(out, case, rank, make())
        dist.barrier()
    # Gathered straight into the memory offered (as the IPC sender offers its bucket's).
    source = DTensorRefitSource(_fsdp2(build_model("qwen3_tied"), mesh), dtype=torch.bfloat16)
    _save(out, "fsdp2_qwen3_tied_bf16_into", rank, source, into=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
