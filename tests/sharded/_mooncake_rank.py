"""One rank of a plan run over Mooncake's data plane on 127.0.0.1 (a test helper).

Run as ``python _mooncake_rank.py RANK WORLD PORT SCENARIO OUT_DIR``. The model,
layouts and checks are ``_p2p_rank.py``'s (the same plan as its ``2x2``); the
control messages go over a gloo group, the buckets over Mooncake. Each rank
writes ``OUT_DIR/rank{RANK}.json`` with what it saw (its error, if any).

Scenarios (2 senders, 2 receivers):

* ``2x2``: two rounds (two syncs, the second with other values) in one process;
  ``rounds`` holds each round's result and checks;
* ``kill``: 64-byte buckets; receiver 1 SIGKILLs itself at its 3rd box;
* ``fail``: sender 1's source raises on ``o``, receiver 0's sink at its 2nd box;
* ``bench``: not a test: a 64 MiB model in 4 MiB buckets over gloo's ``run_plan``,
  then over Mooncake, three times each; ``seconds`` holds each data plane's best.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _p2p_rank import (
    MANIFEST,
    TIMEOUT_S,
    _aiosync_type,
    fsdp_layouts,
    full_tensors,
    slice_of,
    tp_layouts,
)

from aiosync.layout import Layout, Part, even_chunks
from aiosync.transports.sharded import Box, box_within, make_plan, manifest_dtypes, run_plan
from aiosync.transports.sharded._mooncake import run_plan_mooncake

SENDERS = 2
BENCH_MANIFEST: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    f"layer{i}.weight": ((2048, 2048), torch.float32) for i in range(4)
}


def bench_layouts(workers: int, ranks: int) -> tuple[list[Layout], list[Layout]]:
    """FSDP ``Shard(0)`` senders, row-split (dim 0) receivers."""
    sources: list[dict[str, Part]] = [{} for _ in range(ranks)]
    dests: list[dict[str, Part]] = [{} for _ in range(workers)]
    for name, (shape, _) in BENCH_MANIFEST.items():
        for r, (start, length) in enumerate(even_chunks(shape[0], ranks)):
            sources[r][name] = Part(shape, 0, start, length)
        for w, (start, length) in enumerate(even_chunks(shape[1], workers)):
            dests[w][name] = Part(shape, 1, start, length)
    return list(sources), list(dests)


def bench(rank: int, world: int) -> dict[str, Any]:
    sources, dests = bench_layouts(world - SENDERS, SENDERS)
    plan = make_plan(sources, dests, manifest_dtypes(BENCH_MANIFEST), 4 << 20)
    gen = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s, generator=gen) for n, (s, _) in BENCH_MANIFEST.items()}
    sending = rank < SENDERS
    layout = sources[rank] if sending else dests[rank - SENDERS]
    local = {n: slice_of(full[n], p).contiguous() for n, p in layout.items()} if sending else {}
    sink_to = {} if sending else {n: torch.zeros(p.local_shape) for n, p in layout.items()}

    def sink(name: str, box: Box, tensor: torch.Tensor) -> None:
        sink_to[name][box_within(box, layout[name])].copy_(tensor)

    role: dict[str, Any] = {"source": local.__getitem__} if sending else {"sink": sink}
    seconds: dict[str, float] = {}
    for plane, fn in (("gloo", run_plan), ("mooncake", run_plan_mooncake)):
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            fn(plan, dist.group.WORLD, rank, timeout_s=TIMEOUT_S, **role)
            dist.barrier()
            best = min(best, time.perf_counter() - start)
        seconds[plane] = best
    exact = sending or all(torch.equal(t, slice_of(full[n], layout[n])) for n, t in sink_to.items())
    return {"seconds": seconds, "total_bytes": plan.total_nbytes, "exact": exact}


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    scenario, out_dir = sys.argv[4], Path(sys.argv[5])
    workers = world - SENDERS
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    result: dict[str, Any] = {}
    if scenario == "bench":
        result.update(bench(rank, world), ok=True)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    sources, dests = fsdp_layouts(SENDERS), tp_layouts(workers)
    plan = make_plan(sources, dests, manifest_dtypes(MANIFEST), 64 if scenario == "kill" else 256)
    result["digest"] = plan.digest
    calls = 0
    rounds: list[dict[str, Any]] = []
    start = time.monotonic()
    try:
        for round_ in range(2 if scenario == "2x2" else 1):
            # Round r sends other values: a stale buffer cannot pass for the new weights.
            full = {n: t + round_ for n, t in full_tensors().items()}
            locals_: dict[str, torch.Tensor] = {}
            counts: dict[str, torch.Tensor] = {}

            def source(name: str, full: dict[str, torch.Tensor] = full) -> torch.Tensor:
                if scenario == "fail" and rank == 1 and name == "o":
                    raise RuntimeError("injected source failure")
                return slice_of(full[name], sources[rank][name]).contiguous()

            def sink(
                name: str,
                box: Box,
                tensor: torch.Tensor,
                locals_: dict[str, torch.Tensor] = locals_,
                counts: dict[str, torch.Tensor] = counts,
            ) -> None:
                nonlocal calls
                calls += 1
                if scenario == "kill" and rank == world - 1 and calls == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                if scenario == "fail" and rank == SENDERS and calls == 2:
                    raise RuntimeError("injected sink failure")
                part = dests[rank - SENDERS][name]
                if name not in locals_:
                    locals_[name] = torch.zeros(part.local_shape, dtype=tensor.dtype)
                    counts[name] = torch.zeros(part.local_shape, dtype=torch.int64)
                locals_[name][box_within(box, part)].copy_(tensor)
                counts[name][box_within(box, part)] += 1

            one: dict[str, Any] = {}
            if rank < SENDERS:
                got = run_plan_mooncake(
                    plan, dist.group.WORLD, rank, source=source, timeout_s=TIMEOUT_S
                )
                expected = {w: plan.pair_bytes(rank, w) for w in range(workers)}
            else:
                got = run_plan_mooncake(
                    plan, dist.group.WORLD, rank, sink=sink, timeout_s=TIMEOUT_S
                )
                expected = {s: plan.pair_bytes(s, rank - SENDERS) for s in range(SENDERS)}
                layout = dests[rank - SENDERS]
                one["wrong"] = [
                    name
                    for name, part in layout.items()
                    if part.numel
                    and not torch.equal(
                        locals_.get(name, torch.empty(0)), slice_of(full[name], part)
                    )
                ]
                one["not_once"] = [
                    name
                    for name, part in layout.items()
                    if part.numel and not bool((counts.get(name, torch.zeros(1)) == 1).all())
                ]
                one["plan_received"] = plan.receiver_nbytes[rank - SENDERS]
            one.update(
                nbytes=got.nbytes,
                by_peer={str(k): v for k, v in got.by_peer.items()},
                expected={str(k): v for k, v in expected.items()},
                buckets=got.buckets,
            )
            rounds.append(one)
        result.update(ok=True, rounds=rounds)
    except Exception as exc:
        result.update(ok=False, error=_aiosync_type(exc), message=str(exc), rounds=rounds)
        traceback.print_exc()
    result["elapsed_s"] = time.monotonic() - start
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # Leave without tearing the group down: a peer may be dead (its sockets gone).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
