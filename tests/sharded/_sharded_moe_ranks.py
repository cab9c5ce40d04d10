"""One rank of a 3-rank FSDP2 Qwen3-MoE trainer (gloo) refitting a TP=2 embedded engine
through the factory's pick (case C39).

Run as ``python _sharded_moe_ranks.py RANK WORLD_SIZE PG_PORT STORE_PORT OUT_JSON``. Rank
0 holds the engine (one replica, two tensor-parallel workers) and lets the factory
choose (``sharded=None``: the engine reports its layout, so the shard-aware path);
the other ranks, without an engine, say ``sharded=True``. The fused experts
(``mlp.experts.gate_up_proj [4, 64, 64]``) are sharded by FSDP2 over 3 ranks in
uneven chunks of 2, 2 and 0 experts: each rank sends the experts it holds, whole,
under their per-expert checkpoint names. Then the same trainer with its experts
sharded along another dim (``Shard(1)``, not whole experts): the factory keeps the
broadcast, and an explicit ``sharded=True`` is refused naming the tensor. Each rank
writes what it saw to ``OUT_JSON``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aiosync import RefitMismatchError, TrainCluster, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3_MOE
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from tests._support import fsdp2

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


def _moe() -> Any:
    torch.manual_seed(fsdp2.MODEL_SEED)
    items = dict(TINY_QWEN3_MOE)
    config = AutoConfig.for_model(items.pop("model_type"), **items)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_sharded_moe(world: int) -> torch.nn.Module:
    """The tiny Qwen3-MoE (float32), each decoder layer and the model ``fully_shard``-ed."""
    model = _moe()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_experts_cut_along_dim_1(world: int) -> torch.nn.Module:
    """The tiny Qwen3-MoE whose fused expert tensors are DTensors ``Shard(1)`` (rows of
    every expert, not whole experts; FSDP2 refuses uneven dim-1 shards, so built by hand)."""
    model = _moe()
    mesh = init_device_mesh("cpu", (world,))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if type(module).__name__.endswith("Experts"):
                cut = distribute_tensor(param.detach(), mesh, [Shard(1)])
                setattr(module, name, torch.nn.Parameter(cut))
    return model


def _greedy(full: dict[str, torch.Tensor]) -> list[list[int]]:
    from aiosync.engines.embedded.model import HFModelRunner

    runner = HFModelRunner.from_config(dict(TINY_QWEN3_MOE), seed=0)
    runner.load_weights(full.items())
    return runner.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)


def _refusals(rank: int, world: int, store_port: int, engine: Any) -> dict[str, Any]:
    """Experts cut along dim 1: what the factory picks, and what sharded=True says."""
    source = DTensorRefitSource(build_experts_cut_along_dim_1(world))
    options: dict[str, Any] = {
        "colocated": False,
        "backend": "embedded",
        "train_cluster": TrainCluster(world_size=world, rank=rank, master_port=store_port),
        "inference_world_size": 2,
    }
    seen: dict[str, Any] = {}
    if engine is not None:
        picked = create_weight_synchronizer(source, engine, **options)
        seen["picked_for_dim_1"] = type(picked).__name__
    try:
        create_weight_synchronizer(source, engine, sharded=True, **options)
        seen["sharded_dim_1"] = None
    except RefitMismatchError as exc:
        seen["sharded_dim_1"] = str(exc)
    return seen


async def run(rank: int, world: int, store_port: int) -> dict[str, Any]:
    model = build_sharded_moe(world)
    source = DTensorRefitSource(model)
    seen: dict[str, Any] = {"rank": rank}
    async with contextlib.AsyncExitStack() as stack:
        engine: EmbeddedEngine | None = None
        if rank == 0:
            engine = await stack.enter_async_context(
                EmbeddedEngine(
                    TINY_QWEN3_MOE,
                    num_workers=1,
                    tensor_parallel_size=2,
                    seed=fsdp2.ENGINE_SEED,
                    rpc_timeout_s=120,
                )
            )
        sync = fsdp2.factory_rank_sync(
            source,
            engine,
            rank,
            world,
            store_port,
            inference_world_size=2,
            sharded=None if rank == 0 else True,
            bucket_bytes=16 * 1024,
            collective_timeout_s=30.0,
            sync_timeout_s=60.0,
        )
        seen["transport"] = type(sync).__name__
        try:
            await stack.enter_async_context(sync)
        except Exception as exc:
            seen["init_error"] = [type(exc).__name__, str(exc)]
            return seen
        plan = sync.transfer_plan  # type: ignore[attr-defined]
        seen["sender_nbytes"] = list(plan.sender_nbytes)
        for step in range(2):
            await fsdp2.stepped_sync(model, sync, step)
            seen[f"after_{step}"] = fsdp2.versions(sync)
            full = {n: t.clone() for n, t in source.iter_weights()}  # every rank gathers
            if engine is not None:
                seen[f"bit_exact_{step}"] = await fsdp2.slices_match(engine, full)
                got = await engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
                seen[f"tokens_agree_{step}"] = got == _greedy(full)
        seen.update(_refusals(rank, world, store_port + 1, engine))
        dist.barrier()
    return seen


if __name__ == "__main__":
    fsdp2.rank_main(run)
