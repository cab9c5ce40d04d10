"""One sync through a Ray engine actor next to the same sync into the engine in this process.

The same manifest (bf16 tensors of ``--tensor-mb`` MiB: the weights-only
``FlatSource`` of ``benchmarks/ipc.py``, and its ``FlatModel`` as
``fixed_cost.PointModel`` in the engine) is synced into a one-worker embedded
engine two ways, measured in one run (one process, one
local Ray cluster on loopback):

* ``in process``: ``EmbeddedEngine`` driven from this process (the baseline);
* ``ray actor``: the same engine built inside a Ray actor
  (:func:`aiosync.ray.launch_engine`), driven through :class:`aiosync.ray.RayEngine`:
  every engine call of the sync is one more hop (driver -> actor -> workers).

For each transport (IPC, colocated: shared memory; the collective broadcast
over gloo) and size: best seconds of ``--repeats`` syncs (at least 3; 1 with
``--quick``), ``mark_stale()`` outside the timing, after a warm-up sync, and
the ratio ``ray actor / in process``; plus one ``collective_rpc`` round trip
each way, the fixed cost of the actor hop. The bytes never cross Ray (the
transports move them, as in-process); the RPCs that start, drive and commit the
sync do, which is what the ratio measures.

Named ``ray_sync.py``, not ``ray.py``: a script's folder comes first on
``sys.path``, where a ``ray.py`` would shadow the ``ray`` package.

Usage::

    python benchmarks/ray_sync.py            # 16 and 128 MiB, best of 3
    python benchmarks/ray_sync.py --quick    # 16 MiB, best of 2, < 1 minute
    python benchmarks/ray_sync.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import time
from typing import Any

import torch
from _machine import Machine, repeats_for
from ipc import FlatSource  # the weights-only source of the IPC benchmark

# One local cluster on this machine: Ray takes loopback as the node's address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MiB = 1024**2
#: Manifest sizes, MiB (``--quick``: the first).
SIZES_MIB = (16, 128)
TRANSPORTS = ("ipc", "collective")
#: The engine's weights-only model (``ipc.FlatModel`` with what ``embedded_status``
#: reports), imported by name in the engine's workers.
RUNNER = "fixed_cost.PointModel"
#: A local Ray cluster for a 2-core machine.
LOCAL_CLUSTER: dict[str, Any] = {
    "num_cpus": 2,
    "object_store_memory": 80 * MiB,
    "include_dashboard": False,
}


def _spec(total_mib: int, tensor_mb: float) -> dict[str, int]:
    numel = max(1, int(tensor_mb * MiB) // 2)
    return {"count": max(1, total_mib * MiB // (numel * 2)), "numel": numel}


async def _best_sync(engine: Any, source: Any, transport: str, repeats: int) -> float:
    """Best seconds of ``repeats`` syncs of ``source`` into ``engine`` (after a warm-up)."""
    from aiosync import CollectiveOptions, IPCOptions, TrainCluster, create_weight_synchronizer

    topology: dict[str, Any] = {}
    chosen: IPCOptions | CollectiveOptions = IPCOptions(bucket_bytes=8 * MiB)
    if transport == "collective":  # one worker, no tensor-parallel slices: the broadcast
        topology = {"train_cluster": TrainCluster(), "inference_world_size": 1}
        chosen = CollectiveOptions(bucket_bytes=8 * MiB)
    sync = create_weight_synchronizer(
        source,
        engine,
        colocated=transport == "ipc",
        backend="embedded",  # a RayEngine does not report its kind
        transport=chosen,
        **topology,
    )
    best = float("inf")
    async with sync:
        for i in range(repeats + 1):
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            if i:  # the first one maps the buffers, connects, forms caches
                best = min(best, time.perf_counter() - start)
    return best


async def _best_rpc(engine: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(max(10, repeats)):
        start = time.perf_counter()
        await engine.collective_rpc("embedded_status")
        best = min(best, time.perf_counter() - start)
    return best


async def _measure(sizes: list[int], tensor_mb: float, repeats: int) -> list[dict[str, Any]]:
    from aiosync.engines.embedded.engine import EmbeddedEngine
    from aiosync.ray import EngineSpec, launch_engine

    rows: list[dict[str, Any]] = []
    for size in sizes:
        spec = _spec(size, tensor_mb)
        options = {"dtype": "bfloat16", "runner_factory": RUNNER, "threads_per_worker": 1}
        source = FlatSource(spec)
        local = EmbeddedEngine(spec, **options)
        actor = await launch_engine(
            EngineSpec.embedded(spec, **options), colocated=True, num_gpus=0, num_cpus=0
        )
        async with local, actor:
            if not rows:
                rows.append(
                    {
                        "what": "rpc",
                        "bytes": 0,
                        "in_process_s": await _best_rpc(local, repeats),
                        "ray_actor_s": await _best_rpc(actor, repeats),
                    }
                )
            for transport in TRANSPORTS:
                base = await _best_sync(local, source, transport, repeats)
                through = await _best_sync(actor, source, transport, repeats)
                rows.append(
                    {
                        "what": transport,
                        "bytes": spec["count"] * spec["numel"] * 2,
                        "in_process_s": base,
                        "ray_actor_s": through,
                    }
                )
    for row in rows:
        row["ratio"] = round(row["ray_actor_s"] / row["in_process_s"], 3)
        row["in_process_ms"] = round(1e3 * row.pop("in_process_s"), 3)
        row["ray_actor_ms"] = round(1e3 * row.pop("ray_actor_s"), 3)
    return rows


def _print_table(rows: list[dict[str, Any]], machine: Machine, skipped: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="one sync through a Ray engine actor vs the same sync in process (embedded engine)",
        caption=machine.caption(),
    )
    for column in ("measure", "MiB", "in process ms", "ray actor ms", "ray / in process"):
        table.add_column(column, justify="right")
    if skipped is not None:
        table.add_row(f"skipped: {skipped}", "—", "—", "—", "—")
    for row in rows:
        what = "one collective_rpc" if row["what"] == "rpc" else f"one sync ({row['what']})"
        table.add_row(
            what,
            f"{row['bytes'] / MiB:g}" if row["bytes"] else "—",
            f"{row['in_process_ms']:.3f}",
            f"{row['ray_actor_ms']:.3f}",
            f"{row['ratio']:.2f}x",
        )
    Console().print(table)
    if (warning := machine.warning()) is not None:
        print(warning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(SIZES_MIB))
    parser.add_argument("--tensor-mb", type=float, default=4.0, help="MiB per tensor")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs (best kept, >= 3)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, best of 2, < 1 minute")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    repeats = repeats_for(args.quick, args.repeats)
    sizes = args.sizes_mib[:1] if args.quick else args.sizes_mib
    torch.set_num_threads(1)
    machine = Machine(repeats)
    rows: list[dict[str, Any]] = []
    skipped = None
    if importlib.util.find_spec("ray") is None:
        skipped = "Ray is not installed (pip install 'aiosync[ray]')"
    else:
        import ray

        ray.init(**LOCAL_CLUSTER)
        try:
            rows = asyncio.run(_measure(sizes, args.tensor_mb, repeats))
        finally:
            ray.shutdown()
    machine.finish()
    _print_table(rows, machine, skipped)
    if args.json:
        figures: dict[str, Any] = {"benchmark": "ray_sync", "rows": rows, **machine.fields()}
        if skipped is not None:
            figures["skipped"] = skipped
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
