"""Fixed cost of one colocated sync: one 4 KiB tensor over IPC into the embedded engine.

With so few bytes, the copy is nothing and what is left is the protocol: the
time a sync costs whatever the model. Measured in the same run, interleaved
(one of each per iteration, so a change of load hits both alike):

* ``sync``: ``IPCWeightSynchronizer.sync_weights()`` of one bf16 tensor of
  4 KiB (2,048 elements) into a one-worker :class:`~aiosync.EmbeddedEngine`
  (the weights-only ``FlatModel`` of ``benchmarks/ipc.py``), after a warm-up
  sync; ``mark_stale()`` before each, outside the timing.
* ``rpc`` (baseline): one ``engine.collective_rpc("embedded_status")`` round
  trip, the floor of any engine RPC (msgpack over the engine's ZMQ socket).

Median and p90 of ``--syncs`` samples each (50; ``--quick``: 10), in ms, and
the ratio sync / rpc (medians).

Process round trips per sync, read from the code (``transports/ipc/synchronizer.py``,
``transports/ipc/worker.py``, ``engines/embedded/engine.py``), one trainer rank,
one worker, one bucket: three engine RPCs, run one after the other —
``prepare_for_generation(tags=["weights"])`` (``embedded_wake``), then
``aiosync_ipc_receive``, then ``prepare_for_generation(tags=["kv_cache"])``.
Inside the second the worker connects a fresh ZMQ DEALER (with a socket
monitor) to the trainer's ROUTER and the two exchange ``hello`` (worker →
trainer), ``data`` → ``ack`` (one per bucket) and ``end`` → ``done``. On the
critical path that is 11 one-way messages (2 + 7 + 2), i.e. 5.5 RPC-equivalent
round trips, plus packing the bucket into shared memory and the worker's
mapping it and copying out; a ratio near 5.5 means the protocol costs what its
messages do and nothing else.

Usage::

    python benchmarks/fixed_cost.py            # 50 syncs
    python benchmarks/fixed_cost.py --quick    # 10 syncs, < 1 minute
    python benchmarks/fixed_cost.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch
from _machine import Machine
from ipc import FlatModel, FlatSource  # the weights-only model and source of the IPC benchmark

#: One bf16 tensor of 4 KiB: 2,048 elements of 2 bytes.
SPEC = {"count": 1, "numel": 2048}
TENSOR_BYTES = SPEC["count"] * SPEC["numel"] * 2
#: Staging buffer, bytes (1 MiB; the default would take 2 % of the free memory).
BUCKET_BYTES = 1 << 20
#: Serial one-way messages between trainer and worker per sync (see the module docs).
MESSAGES_PER_SYNC = 11
#: ... as round trips, the unit the RPC baseline measures.
ROUND_TRIPS_PER_SYNC = MESSAGES_PER_SYNC / 2


class PointModel(FlatModel):
    """:class:`FlatModel` with the ``kv_scales`` that ``embedded_status`` reports."""

    def __init__(self, spec: Any, *, seed: int = 0, dtype: str = "bfloat16") -> None:
        super().__init__(spec, seed=seed, dtype=dtype)
        self.kv_scales: dict[str, float] = {}


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(samples: int) -> tuple[list[float], list[float]]:
    """``(sync seconds, rpc seconds)``, ``samples`` of each, interleaved."""
    from aiosync.engines.embedded.engine import EmbeddedEngine
    from aiosync.transports.ipc import IPCWeightSynchronizer

    engine = EmbeddedEngine(
        SPEC,
        num_workers=1,
        dtype="bfloat16",
        runner_factory=f"{__name__}.PointModel",
        threads_per_worker=1,  # nothing to parallelise in 4 KiB; keep the cores free
    )
    source = FlatSource(SPEC)
    syncs: list[float] = []
    rpcs: list[float] = []
    # A small staging buffer: its size changes the memory taken at init, not a sync's cost.
    sync = IPCWeightSynchronizer(source, engine, bucket_bytes=BUCKET_BYTES)
    async with engine, sync:
        await sync.init_communicator()
        for _ in range(3):  # warm-up: maps the shared buffers, first connects, caches
            await sync.mark_stale()
            await sync.sync_weights()
            await engine.collective_rpc("embedded_status")
        for _ in range(samples):
            start = time.perf_counter()
            await engine.collective_rpc("embedded_status")
            rpcs.append(time.perf_counter() - start)
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            syncs.append(time.perf_counter() - start)
    return syncs, rpcs


def _summary(seconds: list[float]) -> dict[str, float]:
    """Median and p90, ms."""
    return {
        "median_ms": round(1e3 * statistics.median(seconds), 4),
        "p90_ms": round(1e3 * _percentile(seconds, 0.9), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--syncs", type=int, default=50, help="timed samples of each (>= 3)")
    parser.add_argument("--quick", action="store_true", help="10 samples, < 1 minute")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    samples = 10 if args.quick else max(3, args.syncs)
    torch.set_num_threads(1)  # a 4 KiB pack needs no OpenMP team spinning on shared cores
    machine = Machine(samples)
    sync_s, rpc_s = asyncio.run(_measure(samples))
    machine.finish()
    sync, rpc = _summary(sync_s), _summary(rpc_s)
    ratio = round(sync["median_ms"] / rpc["median_ms"], 3)
    _print_table(sync, rpc, ratio, machine)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "fixed_cost",
                    "tensor_bytes": TENSOR_BYTES,
                    "sync": sync,
                    "rpc": rpc,
                    "ratio_sync_vs_rpc": ratio,
                    "round_trips_per_sync": ROUND_TRIPS_PER_SYNC,
                    "messages_per_sync": MESSAGES_PER_SYNC,
                    **machine.fields(),
                }
            )
        )


def _print_table(
    sync: dict[str, float], rpc: dict[str, float], ratio: float, machine: Machine
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"fixed cost of one IPC sync ({TENSOR_BYTES} B tensor, embedded engine, 1 worker)",
        caption=machine.caption("median, p90"),
    )
    for column in ("measure", "median ms", "p90 ms", "/ rpc"):
        table.add_column(column, justify="right")
    table.add_row(
        "one RPC (embedded_status)", f"{rpc['median_ms']:.3f}", f"{rpc['p90_ms']:.3f}", "1"
    )
    table.add_row(
        "one sync (IPC)", f"{sync['median_ms']:.3f}", f"{sync['p90_ms']:.3f}", f"{ratio:.2f}x"
    )
    Console().print(table)
    print(
        f"a sync makes 3 engine RPCs and {MESSAGES_PER_SYNC} serial one-way messages "
        f"({ROUND_TRIPS_PER_SYNC:g} round trips): / rpc near {ROUND_TRIPS_PER_SYNC:g} means "
        "the messages are the whole cost"
    )
    if (warning := machine.warning()) is not None:
        print(warning)


if __name__ == "__main__":
    main()
