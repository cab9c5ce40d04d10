"""One rank of a point-to-point plan run on 127.0.0.1 (a test helper).

Run as ``python _p2p_rank.py RANK WORLD PORT SCENARIO OUT_DIR [PLANE]``. ``PLANE``:
``gloo`` (the default: ``run_plan``, every bucket over gloo) or ``mooncake``
(``run_plan_mooncake``: the control messages over a gloo group, the buckets over
Mooncake's data plane). Every rank builds the same full tensors (seeded), the same
layouts and the same plan, then runs its share: senders read their parts of the full
tensors, receivers store each box into zeroed local parts and count how often each
element was written. Each rank writes ``OUT_DIR/rank{RANK}.json`` with what it saw:
``rounds``, each round's bytes and checks, and its error, if any.

Scenarios (``T`` senders, ``W`` receivers):

* ``2x2``: FSDP2-like ``Shard(0)`` senders, TP=2 receivers (column- and
  row-parallel, replicated, a 0-d tensor, an empty chunk, a split tensor); two rounds
  (two syncs, the second with other values) in one process;
* ``1x2``: the full model on one sender, over a bare ``ProcessGroupGloo``;
* ``2x1``: two senders, one receiver holding everything;
* ``kill``: ``2x2`` with small buckets; receiver 1 SIGKILLs itself at its 3rd box;
* ``mismatch``: ``1x1``, the receiver planned with another bucket size;
* ``fail``: ``2x2``; sender 1's source raises on ``o``, receiver 0's sink at its 2nd box;
* ``bench`` (``mooncake``; not a test): a 64 MiB model in 4 MiB buckets over gloo's
  ``run_plan``, then over Mooncake, three times each; ``seconds`` holds each data
  plane's best.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from aiosync.layout import Layout, Part, box_of, even_chunks
from aiosync.transports.sharded import (
    Box,
    P2PResult,
    box_within,
    make_plan,
    manifest_dtypes,
    run_plan,
    single_rank_layouts,
)

#: Each scenario's senders (the other ranks receive).
SENDERS = {"2x2": 2, "1x2": 1, "2x1": 2, "kill": 2, "mismatch": 1, "fail": 2, "bench": 2}

#: Limit of every wait, seconds; a failure must surface as an error, never as this.
TIMEOUT_S = 30.0

MANIFEST: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "q": ((8, 6), torch.float32),  # column-parallel on the workers
    "o": ((6, 10), torch.bfloat16),  # row-parallel
    "ids": ((5,), torch.int64),  # FSDP chunks 3 + 2, replicated on the workers
    "scale": ((), torch.float32),  # 0-d: whole on every rank
    "tiny": ((1, 3), torch.float32),  # FSDP: rank 1's chunk is empty
    "emb": ((16, 8), torch.float32),  # 512 bytes: split across buckets
}


def _aiosync_type(exc: BaseException) -> str:
    """The public aiosync error class ``exc`` is (LinkLost is a TransportError)."""
    from aiosync import errors

    for cls in type(exc).__mro__:
        if cls.__module__ == errors.__name__:
            return cls.__name__
    return type(exc).__name__


def full_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in MANIFEST.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)
    return out


def fsdp_layouts(ranks: int) -> list[Layout]:
    layouts: list[dict[str, Part]] = [{} for _ in range(ranks)]
    for name, (shape, _) in MANIFEST.items():
        for rank in range(ranks):
            if not shape:
                layouts[rank][name] = Part.whole(shape)
                continue
            start, length = even_chunks(shape[0], ranks)[rank]
            layouts[rank][name] = Part(shape, 0, start, length)
    return list(layouts)


def tp_layouts(workers: int) -> list[Layout]:
    dims = {"q": 0, "o": 1, "emb": 0}
    layouts: list[dict[str, Part]] = [{} for _ in range(workers)]
    for name, (shape, _) in MANIFEST.items():
        for w in range(workers):
            if name in dims:
                start, length = even_chunks(shape[dims[name]], workers)[w]
                layouts[w][name] = Part(shape, dims[name], start, length)
            else:
                layouts[w][name] = Part.whole(shape)
    return list(layouts)


def slice_of(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    return tensor[box_within(box_of(part), Part.whole(part.shape))]


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
    sources, dests = bench_layouts(world - SENDERS["bench"], SENDERS["bench"])
    plan = make_plan(sources, dests, manifest_dtypes(BENCH_MANIFEST), 4 << 20)
    gen = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s, generator=gen) for n, (s, _) in BENCH_MANIFEST.items()}
    sending = rank < SENDERS["bench"]
    layout = sources[rank] if sending else dests[rank - SENDERS["bench"]]
    local = {n: slice_of(full[n], p).contiguous() for n, p in layout.items()} if sending else {}
    sink_to = {} if sending else {n: torch.zeros(p.local_shape) for n, p in layout.items()}

    def sink(name: str, box: Box, tensor: torch.Tensor) -> None:
        sink_to[name][box_within(box, layout[name])].copy_(tensor)

    role: dict[str, Any] = {"source": local.__getitem__} if sending else {"sink": sink}
    seconds: dict[str, float] = {}
    from aiosync.transports.sharded._mooncake import run_plan_mooncake

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
    plane = sys.argv[6] if len(sys.argv) > 6 else "gloo"
    senders = SENDERS[scenario]
    workers = world - senders
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    group: Any
    if scenario == "1x2":  # a bare backend, as the collective transport builds its groups
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout)
        group = dist.ProcessGroupGloo(store, rank, world, timeout)
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        group = dist.group.WORLD
    if scenario == "bench":
        _leave(out_dir, rank, {**bench(rank, world), "ok": True})
    run: Callable[..., P2PResult] = run_plan
    if plane == "mooncake":
        from aiosync.transports.sharded._mooncake import run_plan_mooncake

        run = run_plan_mooncake
    sources = single_rank_layouts(MANIFEST, 1) if senders == 1 else fsdp_layouts(senders)
    dests = tp_layouts(workers)
    bucket_bytes = {"kill": 64, "mismatch": 256}.get(scenario, 256)
    if scenario == "mismatch" and rank >= senders:
        bucket_bytes = 512
    plan = make_plan(sources, dests, manifest_dtypes(MANIFEST), bucket_bytes)
    result: dict[str, Any] = {"digest": plan.digest}
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
                if scenario == "fail" and rank == senders and calls == 2:
                    raise RuntimeError("injected sink failure")
                part = dests[rank - senders][name]
                if name not in locals_:
                    locals_[name] = torch.zeros(part.local_shape, dtype=tensor.dtype)
                    counts[name] = torch.zeros(part.local_shape, dtype=torch.int64)
                locals_[name][box_within(box, part)].copy_(tensor)
                counts[name][box_within(box, part)] += 1

            one: dict[str, Any] = {}
            if rank < senders:
                got = run(plan, group, rank, source=source, timeout_s=TIMEOUT_S)
                expected = {w: plan.pair_bytes(rank, w) for w in range(workers)}
            else:
                got = run(plan, group, rank, sink=sink, timeout_s=TIMEOUT_S)
                expected = {s: plan.pair_bytes(s, rank - senders) for s in range(senders)}
                layout = dests[rank - senders]
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
                one["plan_received"] = plan.receiver_nbytes[rank - senders]
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
    _leave(out_dir, rank, result)


def _leave(out_dir: Path, rank: int, result: dict[str, Any]) -> NoReturn:
    """Write ``result`` and exit at once, without tearing the group down: a peer may be
    dead (its sockets gone)."""
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
