"""One sync into an SGLang *server* next to the same sync into an engine in this process.

The same manifest (a qwen3-shaped bf16 checkpoint, random values: content does
not change the bytes' path) is synced three ways, measured in one run:

* ``in process`` (the baseline): the collective broadcast over gloo into a
  one-worker :class:`aiosync.EmbeddedEngine` this process drives;
* ``SGLang server, colocated (HTTP)``: :class:`HTTPWeightSynchronizer` into a real
  ``aiosync.testing.sglang_server`` process (tensor handles of shared-memory
  buckets through ``/update_weights_from_tensor``);
* ``SGLang server, disaggregated``: :class:`SGLangCollectiveWeightSynchronizer` into
  the same server: SGLang's weight-update group (gloo over loopback, the server's
  worker a real member) and ``/update_weights_from_distributed`` per bucket.

Each row: best seconds of ``--repeats`` syncs (at least 3; 1 with ``--quick``)
after one warm-up, ``mark_stale()`` outside the timing, and the ratio to the
baseline. The load average at start and end is printed beside the table
(``_machine``): the figures count only as ratios, on an idle machine. The remote
vLLM server's syncs are the in-process IPC and collective paths plus one
``/collective_rpc`` hop per worker call; they need ``.venv-vllm`` and are not
measured here.

Usage::

    python benchmarks/server_sync.py            # ~0.29 GB, best of 3
    python benchmarks/server_sync.py --quick    # ~31 MB, best of 2, < 1 minute
    python benchmarks/server_sync.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table
from sglang_http import FULL, QUICK, _random_source, _start_server

from aiosync import EmbeddedEngine, SGLangHTTPBackend, TrainCluster, WeightSynchronizer
from aiosync.testing import StateDictSource
from aiosync.transports.collective import (
    CollectiveWeightSynchronizer,
    SGLangCollectiveWeightSynchronizer,
)
from aiosync.transports.http import HTTPWeightSynchronizer

GB = 1e9
BUCKET_BYTES = 32 * 2**20
#: ~0.29 GB of bf16 tensors (8 of FULL's 30 layers).
MID = {**FULL, "num_hidden_layers": 8}


async def _best(sync: WeightSynchronizer, repeats: int) -> float:
    """Best seconds of ``repeats`` syncs after one warm-up (which also initializes)."""
    await sync.init_communicator()
    times = []
    for _ in range(repeats + 1):
        await sync.mark_stale()
        start = time.perf_counter()
        await sync.sync_weights()
        times.append(time.perf_counter() - start)
    await sync.shutdown()
    return min(times[1:])


async def _in_process(config: dict[str, Any], source: StateDictSource, repeats: int) -> float:
    async with EmbeddedEngine(dict(config), num_workers=1, dtype="bfloat16", seed=1) as engine:
        sync = CollectiveWeightSynchronizer(
            source,
            engine,
            train_cluster=TrainCluster(master_addr="127.0.0.1"),
            inference_world_size=1,
            dist_backend="gloo",
            bucket_bytes=BUCKET_BYTES,
        )
        return await _best(sync, repeats)


async def _server(
    url: str, source: StateDictSource, repeats: int, make: Callable[..., WeightSynchronizer]
) -> float:
    async with SGLangHTTPBackend(url, request_timeout_s=600) as backend:
        return await _best(make(source, backend), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~31 MB manifest, < 1 minute")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best; >= 3)")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the server inherits it: loopback only
    torch.set_num_threads(1)
    machine = Machine(repeats_for(args.quick, args.repeats))
    config = QUICK if args.quick else MID
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_server(config, Path(tmp), "--threads", "1")
        try:
            source, nbytes = _random_source(url)
            runs: list[tuple[str, Callable[[], Awaitable[float]]]] = [
                (
                    "in process: collective (gloo) into EmbeddedEngine",
                    lambda: _in_process(config, source, machine.repeats),
                ),
                (
                    "SGLang server, colocated: HTTP tensor handles",
                    lambda: _server(
                        url,
                        source,
                        machine.repeats,
                        lambda s, b: HTTPWeightSynchronizer(s, b, bucket_bytes=BUCKET_BYTES),
                    ),
                ),
                (
                    "SGLang server, disaggregated: weight-update group (gloo)",
                    lambda: _server(
                        url,
                        source,
                        machine.repeats,
                        lambda s, b: SGLangCollectiveWeightSynchronizer(
                            s,
                            b,
                            train_cluster=TrainCluster(master_addr="127.0.0.1"),
                            dist_backend="gloo",
                            bucket_bytes=BUCKET_BYTES,
                        ),
                    ),
                ),
            ]
            for label, run in runs:
                rows.append((label, asyncio.run(run())))
        finally:
            proc.terminate()
            proc.wait(60)
    machine.finish()

    base = rows[0][1]
    table = Table(
        title=f"one sync, {nbytes / GB:.3f} GB bf16, {len(source.state_dict)} tensors, "
        f"buckets of {BUCKET_BYTES // 2**20} MiB",
        caption=machine.caption(),
    )
    for column in ("path", "s", "GB/s", "ratio to in process"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for label, seconds in rows:
        table.add_row(
            label, f"{seconds:.3f}", f"{nbytes / seconds / GB:.2f}", f"{seconds / base:.2f}"
        )
    Console().print(table)
    machine.report()
    if args.json:
        result = {
            "benchmark": "server_sync",
            "nbytes": nbytes,
            "tensors": len(source.state_dict),
            "bucket_bytes": BUCKET_BYTES,
            "rows": [
                {"path": label, "seconds": s, "ratio_to_in_process": s / base} for label, s in rows
            ],
            **machine.fields(),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
