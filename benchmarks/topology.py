"""Refit time as the topology grows: trainer ranks paired per device, and engine fleets.

One manifest (``--size-mb`` of bf16 tensors), three colocated IPC topologies,
measured in the same run:

* ``1 rank -> 1 worker``: the baseline.
* ``2 ranks -> 2 workers``: a sharded trainer (rank 1 in a second process, gloo
  group); each rank feeds the worker standing for its device, both at once.
* ``1 rank -> 2 engines``: an :class:`~aiosync.EngineFleet` of two one-worker engines.

Each worker receives the whole manifest, so "delivered" bytes grow with the
workers. ``time / baseline`` should stay near 1 where the copies run in
parallel (the paired design), and "delivered GB/s" should not fall as ranks
grow. On a 2-core CPU machine the engines' copies compete for the same cores;
on GPUs each pair has its own device. Best of ``--repeats`` (at least 3; 1 when
``--quick``); the 1-minute load average at start and end is printed with the
figures (``_machine``; take them on an idle machine).

Usage::

    python benchmarks/topology.py            # 256 MB
    python benchmarks/topology.py --quick    # 32 MB, < 1 minute
    python benchmarks/topology.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _machine import Machine, repeats_for
from ipc import FlatSource, _spec  # the weights-only model and source of the IPC benchmark

GB = 1e9
MiB = 1024**2
RUNNER = "ipc.FlatModel"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _timed_syncs(sync: Any, repeats: int) -> float:
    """Best seconds of ``repeats`` syncs, after a warm-up sync (maps and faults the buffers)."""
    await sync.init_communicator()
    await sync.mark_stale()
    await sync.sync_weights()
    best = float("inf")
    for _ in range(repeats):
        await sync.mark_stale()
        start = time.perf_counter()
        await sync.sync_weights()
        best = min(best, time.perf_counter() - start)
    return best


def _engine(spec: dict[str, int], workers: int, labels: list[str] | None = None) -> Any:
    from aiosync.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(
        spec,
        num_workers=workers,
        dtype="bfloat16",
        runner_factory=RUNNER,
        device_labels=labels,
        worker_extension_cls="aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension",
    )


async def _single(spec: dict[str, int], bucket_bytes: int, repeats: int) -> float:
    from aiosync.transports.ipc import IPCWeightSynchronizer

    async with _engine(spec, 1) as engine:
        sync = IPCWeightSynchronizer(FlatSource(spec), engine, bucket_bytes=bucket_bytes)
        async with sync:
            return await _timed_syncs(sync, repeats)


async def _fleet(spec: dict[str, int], bucket_bytes: int, repeats: int) -> float:
    from aiosync.engines.fleet import EngineFleet
    from aiosync.transports.ipc import IPCWeightSynchronizer

    async with _engine(spec, 1) as a, _engine(spec, 1) as b:
        fleet = EngineFleet([a, b])
        sync = IPCWeightSynchronizer(FlatSource(spec), fleet, bucket_bytes=bucket_bytes)
        async with sync:
            return await _timed_syncs(sync, repeats)


async def _sharded_rank(rank: int, spec: dict[str, int], bucket_bytes: int, repeats: int) -> float:
    import torch.distributed as dist

    from aiosync.transports.ipc import IPCWeightSynchronizer

    source = FlatSource(spec)
    if rank == 0:
        async with _engine(spec, 2, labels=["cpu:0", "cpu:1"]) as engine:
            sync = IPCWeightSynchronizer(
                source,
                engine,
                bucket_bytes=bucket_bytes,
                process_group=dist.group.WORLD,
                device_label="cpu:0",
            )
            async with sync:
                return await _timed_syncs(sync, repeats)
    sync = IPCWeightSynchronizer(
        source,
        None,
        bucket_bytes=bucket_bytes,
        process_group=dist.group.WORLD,
        device_label=f"cpu:{rank}",
    )
    async with sync:
        return await _timed_syncs(sync, repeats)


def _sharded_main(rank: int, port: int, spec: dict[str, int], bucket: int, repeats: int) -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        return anyio.run(_sharded_rank, rank, spec, bucket, repeats)
    finally:
        dist.destroy_process_group()


def _sharded(spec: dict[str, int], bucket_bytes: int, repeats: int) -> float:
    port = _free_port()
    other = multiprocessing.get_context("spawn").Process(
        target=_sharded_main, args=(1, port, spec, bucket_bytes, repeats), daemon=True
    )
    other.start()
    try:
        return _sharded_main(0, port, spec, bucket_bytes, repeats)
    finally:
        other.join(timeout=120)
        if other.is_alive():
            other.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=256.0, help="manifest size, MB (1e6 B)")
    parser.add_argument("--quick", action="store_true", help="a 32 MB manifest")
    parser.add_argument("--tensor-mb", type=float, default=4.0, help="size of each tensor, MiB")
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="staging buffer, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per case (best)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    size_mb = 32.0 if args.quick else args.size_mb
    repeats = repeats_for(args.quick, args.repeats)
    spec = _spec(int(size_mb * 1e6), args.tensor_mb)
    nbytes = spec["count"] * spec["numel"] * 2
    bucket_bytes = int(args.bucket_mb * MiB)
    machine = Machine(repeats)
    args3 = (spec, bucket_bytes, repeats)
    cases = [
        ("1 rank -> 1 worker", 1, 1, lambda: anyio.run(_single, *args3)),
        ("2 ranks -> 2 workers (paired)", 2, 2, lambda: _sharded(*args3)),
        ("1 rank -> 2 engines (fleet)", 1, 2, lambda: anyio.run(_fleet, *args3)),
    ]
    rows: list[dict[str, Any]] = []
    for name, ranks, workers, run in cases:
        seconds = run()
        rows.append(
            {
                "case": name,
                "trainer_ranks": ranks,
                "workers": workers,
                "delivered_bytes": nbytes * workers,
                "seconds": round(seconds, 4),
                "delivered_gbps": round(nbytes * workers / seconds / GB, 3),
            }
        )
    for row in rows:
        row["time_ratio"] = round(row["seconds"] / rows[0]["seconds"], 3)
    machine.finish()
    _print_table(rows, nbytes, machine)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "topology",
                    "manifest_bytes": nbytes,
                    "bucket_bytes": bucket_bytes,
                    **machine.fields(),
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                }
            )
        )


def _print_table(rows: list[dict[str, Any]], nbytes: int, machine: Machine) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"colocated IPC refit of {nbytes / GB:.3f} GB per worker", caption=machine.caption()
    )
    for column in ("topology", "delivered GB", "seconds", "delivered GB/s", "time / 1x1"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["case"],
            f"{row['delivered_bytes'] / GB:.3f}",
            f"{row['seconds']:.3f}",
            f"{row['delivered_gbps']:.2f}",
            f"{row['time_ratio']:.2f}x",
        )
    Console().print(table)
    if (warning := machine.warning()) is not None:
        print(warning)


if __name__ == "__main__":
    main()
