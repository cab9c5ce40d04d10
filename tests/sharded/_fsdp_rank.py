"""One rank of an FSDP2 trainer (ranks 0-1) sending its own shards to two TP workers (ranks 2-3).

Run as ``python _fsdp_rank.py RANK 4 PORT OUT_DIR``. One gloo world of 4 ranks:

1. The trainer ranks check the source layouts of a small plain module behind a
   DDP-like ``module.`` wrapper (FSDP2 on uneven and empty chunks, a ``Shard(1)``
   and a ``Replicate`` DTensor, a buffer) against ``full_tensor()``, and write the
   problems found to ``OUT_DIR/layouts.rank{r}.json``.
2. They build a tiny Qwen3 (tied embeddings) under FSDP2, gather its checkpoint
   (rank 0 saves it as ``OUT_DIR/full.pt``) and broadcast their layouts and the
   manifest to the workers.
3. Every rank plans; the trainer ranks send their local shards
   (``local_tensor_fn``), the workers store what they receive into their TP
   parts (column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel
   embedding, the rest whole) and save them as ``OUT_DIR/worker{w}.pt``. Each
   rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from aiosync.layout import Layout, Part, box_of, even_chunks
from aiosync.refit import DTensorRefitSource
from aiosync.transports.packing import dtype_from_name, dtype_name
from aiosync.transports.sharded import (
    Box,
    box_within,
    dtensor_layout,
    dtensor_layouts,
    iter_local_tensors,
    local_tensor_fn,
    make_plan,
    run_plan,
)

TIMEOUT_S = 30.0
TRAINERS = 2
WORKERS = 2
COLUMN = ("q_proj", "gate_proj", "up_proj", "embed_tokens")
#: One KV head over TP=2: each worker holds it whole, as vLLM replicates KV heads.
KV = ("k_proj", "v_proj")
ROW = ("o_proj", "down_proj")


def _aiosync_type(exc: BaseException) -> str:
    """The public aiosync error class ``exc`` is (LinkLost is a TransportError)."""
    from aiosync import errors

    for cls in type(exc).__mro__:
        if cls.__module__ == errors.__name__:
            return cls.__name__
    return type(exc).__name__


def full_slice(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    return tensor[box_within(box_of(part), Part.whole(part.shape))]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(5, 4))  # FSDP chunks 3 + 2
        self.b = nn.Parameter(torch.randn(1))  # FSDP chunks 1 + 0 (empty)
        self.register_buffer("buf", torch.arange(3.0))  # a plain tensor on every rank


class _Wrapper(nn.Module):
    """Adds ``module.`` to every key, as DDP does; the source strips it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def check_plain_layouts(rank: int, mesh: DeviceMesh) -> list[str]:
    torch.manual_seed(0)
    net = _Net()
    fully_shard(net, mesh=mesh)
    # Two parameters as DTensors of other placements (not FSDP's).
    net.c = nn.Parameter(distribute_tensor(torch.randn(3, 5), mesh, [Shard(1)]))
    net.d = nn.Parameter(distribute_tensor(torch.randn(2, 2), mesh, [Replicate()]))
    source = DTensorRefitSource(_Wrapper(net), dtype=torch.bfloat16)
    problems: list[str] = []
    expected = {
        "a": [Part((5, 4), 0, 0, 3), Part((5, 4), 0, 3, 2)],
        "b": [Part((1,), 0, 0, 1), Part((1,), 0, 1, 0)],
        "c": [Part((3, 5), 1, 0, 3), Part((3, 5), 1, 3, 2)],
        "d": [Part.whole((2, 2))] * 2,
        "buf": [Part.whole((3,))] * 2,
    }
    for r in range(TRAINERS):
        got = dict(dtensor_layout(source, r))
        want = {name: parts[r] for name, parts in expected.items()}
        if got != want:
            problems.append(f"layout of rank {r}: {got} != {want}")
    if set(source.prepare_refit_info()) != set(expected):
        problems.append(f"names {list(source.prepare_refit_info())}")
    streamed = [(n, tuple(t.shape)) for n, t in iter_local_tensors(source, rank)]
    if streamed != [(n, parts[rank].local_shape) for n, parts in expected.items()]:
        problems.append(f"iter_local_tensors: {streamed}")
    local = local_tensor_fn(source)
    state = _Wrapper(net).state_dict()
    for name, parts in expected.items():
        tensor = state[f"module.{name}"]
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        mine = local(name)
        want_t = full_slice(full.to(torch.bfloat16), parts[rank])
        if (
            mine.dtype != torch.bfloat16
            or not mine.is_contiguous()
            or not torch.equal(mine, want_t)
        ):
            problems.append(f"local {name}: {mine} != {want_t}")
    return problems


def tp_layouts(manifest: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[Layout]:
    layouts: list[dict[str, Part]] = [{} for _ in range(WORKERS)]
    for name, (shape, _) in manifest.items():
        dim = 0 if any(k in name for k in COLUMN) else 1 if any(k in name for k in ROW) else None
        for w in range(WORKERS):
            if dim is None or any(k in name for k in KV):
                layouts[w][name] = Part.whole(shape)
            else:
                start, length = even_chunks(shape[dim], WORKERS)[w]
                layouts[w][name] = Part(shape, dim, start, length)
    return layouts


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    mesh = DeviceMesh("cpu", torch.arange(TRAINERS))  # the trainer ranks only
    result: dict[str, Any] = {"ok": False}
    source: DTensorRefitSource | None = None
    shared: list[Any] = [None]
    if rank < TRAINERS:
        (out / f"layouts.rank{rank}.json").write_text(json.dumps(check_plain_layouts(rank, mesh)))
        from transformers import Qwen3Config, Qwen3ForCausalLM

        # vocab 37: FSDP chunks 19 + 18; hidden 16, MLP 24, 1 layer, 2 heads, 1 KV head of 8.
        sizes = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1)
        heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        config = Qwen3Config(**sizes, **heads, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = DTensorRefitSource(model, dtype=torch.float32)
        full = dict(source.iter_weights())  # a collective over the trainer ranks
        if rank == 0:
            torch.save(full, out / "full.pt")
            manifest = source.prepare_refit_info()
            shared[0] = {
                "manifest": [[n, list(s), dtype_name(d)] for n, (s, d) in manifest.items()],
                "layouts": [
                    {n: p.to_wire() for n, p in lay.items()}
                    for lay in dtensor_layouts(source, TRAINERS)
                ],
            }
    dist.broadcast_object_list(shared, src=0)
    manifest = {n: (tuple(s), dtype_from_name(d)) for n, s, d in shared[0]["manifest"]}
    sources = [{n: Part.from_wire(p) for n, p in lay.items()} for lay in shared[0]["layouts"]]
    dests = tp_layouts(manifest)
    plan = make_plan(sources, dests, {n: d for n, (_, d) in manifest.items()}, 4096)
    received: dict[str, torch.Tensor] = {}

    def sink(name: str, box: Box, tensor: torch.Tensor) -> None:
        part = dests[rank - TRAINERS][name]
        if name not in received:
            received[name] = torch.zeros(part.local_shape, dtype=tensor.dtype)
        received[name][box_within(box, part)].copy_(tensor)

    try:
        if source is not None:
            got = run_plan(
                plan, dist.group.WORLD, rank, source=local_tensor_fn(source), timeout_s=TIMEOUT_S
            )
        else:
            got = run_plan(plan, dist.group.WORLD, rank, sink=sink, timeout_s=TIMEOUT_S)
            w = rank - TRAINERS
            torch.save(
                {"received": received, "parts": {n: p.to_wire() for n, p in dests[w].items()}},
                out / f"worker{w}.pt",
            )
            result["plan_received"] = plan.receiver_nbytes[w]
        result.update(ok=True, nbytes=got.nbytes, sender_nbytes=list(plan.sender_nbytes))
    except Exception as exc:
        result.update(error=_aiosync_type(exc), message=str(exc))
        traceback.print_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
