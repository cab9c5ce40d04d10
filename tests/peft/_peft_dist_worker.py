"""One rank of the 2-process gloo tests: shard PEFT models with FSDP2, stream them, save.

Run as ``python _peft_dist_worker.py RANK WORLD_SIZE PORT OUT_DIR``. Reuses the
refit_torch worker's ``_save`` (``OUT_DIR/{case}.rank{r}.safetensors`` and
``.json``); the cases are ``_peft_models.FSDP2_CASES``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import PeftModel
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "refit_torch"))
from _dist_worker import _save
from _peft_models import FSDP2_CASES, build_peft

from aiosync.refit import DTensorRefitSource, LoRAAdapterRefitSource


def _fsdp2(model: PeftModel, mesh: DeviceMesh) -> PeftModel:
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    for case, (kind, dtype_name, kwargs) in FSDP2_CASES.items():
        model = _fsdp2(build_peft(**kwargs), mesh)
        dtype = None if dtype_name is None else getattr(torch, dtype_name)
        source = (
            DTensorRefitSource(model, dtype=dtype)
            if kind == "merged"
            else LoRAAdapterRefitSource(model, dtype=dtype)
        )
        assert any(hasattr(p, "placements") for p in model.parameters()), "not sharded"
        _save(out, case, rank, source)  # type: ignore[arg-type]
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
