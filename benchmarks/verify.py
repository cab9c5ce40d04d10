"""What verification costs: one sync per transport with ``verify=False``, ``"sample"`` and ``True``.

The same bf16 qwen3-shaped checkpoint (random values) is synced, in one run, over:

* ``ipc``: :class:`IPCWeightSynchronizer` into a one-worker :class:`aiosync.EmbeddedEngine`
  (shared-memory buckets, the worker copies out of them);
* ``collective``: :class:`CollectiveWeightSynchronizer` (gloo over loopback) into one;
* ``http``: :class:`HTTPWeightSynchronizer` into the SGLang-contract test server
  (``python -m aiosync.testing.sglang_server``), whose check is a read-back through
  ``/get_weights_by_name`` (not in ``--quick``: its ``verify=True`` reads every tensor
  back as JSON).

For each transport one synchronizer syncs in rounds, each round one sync per mode
(``verify`` set between syncs, so that the modes share the engine, the buffers and the
machine's moment); a row is the best of ``--repeats`` rounds (at least 3; ``--quick``:
1), after one warm-up, with ``mark_stale()`` outside the timing, and its ratio to
``verify=False`` of the same transport in the same run (HTTP's ``verify=True`` is timed
once). ``verify=True`` (IPC's and the collective's default) is the block-sum digest of
every byte, taken while packing and as each worker loads (``aiosync/_digest.py``); the
line under the table states its ratio per transport against the goal (issue 42:
<= 1.05). The ``verify_engine()`` row times the read-back check of every live tensor
(SHA-256 on both sides, no weights moved) after a sync, as a ratio to the sync itself.
``uptime`` is printed at the start and at the end: the figures count only as ratios on
an idle machine.

Usage::

    python benchmarks/verify.py            # ~0.39 GB, best of 3 (the figure)
    python benchmarks/verify.py --quick    # ~31 MB, best of 1, seconds (a smoke test)
    python benchmarks/verify.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table
from sglang_http import FULL, QUICK, _random_source, _start_server

from aiosync import EmbeddedEngine, SGLangHTTPBackend, TrainCluster, WeightSynchronizer
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.testing import StateDictSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer

GB = 1e9
BUCKET_BYTES = 32 * 2**20
#: ~0.39 GB of bf16 tensors (8 of FULL's 30 layers).
MID = {**FULL, "num_hidden_layers": 8}
MODES: tuple[bool | str, ...] = (False, "sample", True)
#: The most ``verify=True`` may cost, as a ratio to ``verify=False`` (issue 42).
FULL_GOAL = 1.05


def _uptime() -> str:
    """``uptime``'s line (the load averages over 1, 5 and 15 minutes)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _label(mode: bool | str) -> str:
    return {False: "verify=False", "sample": 'verify="sample"', True: "verify=True"}[mode]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _rounds(
    sync: WeightSynchronizer, repeats: int, readback: bool, once: tuple[bool | str, ...] = ()
) -> dict[str, float]:
    """Best seconds per mode (and of ``verify_engine()`` when ``readback``) over
    ``repeats`` rounds after a warm-up round; the modes in ``once`` only in the
    first timed round (a single sample: they cost hundreds of syncs)."""
    await sync.init_communicator()
    best: dict[str, float] = {}
    for round_ in range(repeats + 1):
        for mode in MODES:
            if mode in once and round_ != 1:
                continue
            sync.verify = mode  # type: ignore[attr-defined]
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            seconds = time.perf_counter() - start
            if round_:
                best[_label(mode)] = min(best.get(_label(mode), seconds), seconds)
        if readback:
            start = time.perf_counter()
            await sync.verify_engine()
            seconds = time.perf_counter() - start
            if round_:
                best["verify_engine()"] = min(best.get("verify_engine()", seconds), seconds)
    await sync.shutdown()
    return best


async def _embedded(
    config: dict[str, Any], source: StateDictSource, repeats: int, transport: str
) -> dict[str, float]:
    async with EmbeddedEngine(dict(config), num_workers=1, dtype="bfloat16", seed=1) as engine:
        sync: WeightSynchronizer
        if transport == "ipc":
            sync = IPCWeightSynchronizer(source, engine, bucket_bytes=BUCKET_BYTES)
        else:
            sync = CollectiveWeightSynchronizer(
                source,
                engine,
                train_cluster=TrainCluster(master_addr="127.0.0.1", master_port=_port()),
                inference_world_size=1,
                dist_backend="gloo",
                bucket_bytes=BUCKET_BYTES,
            )
        return await _rounds(sync, repeats, readback=True)


async def _http(url: str, source: StateDictSource, repeats: int) -> dict[str, float]:
    async with SGLangHTTPBackend(url, request_timeout_s=600) as backend:
        sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=BUCKET_BYTES)
        return await _rounds(sync, repeats, readback=False, once=(True,))


def _local_source(config: dict[str, Any]) -> tuple[StateDictSource, int]:
    """Random bf16 tensors of the embedded engine's manifest for ``config`` (what
    ``_random_source`` reads from the test server), and their bytes."""
    names = HFModelRunner.from_config(dict(config), seed=0).expected_manifest()
    source = StateDictSource.random({n: (shape, torch.bfloat16) for n, (shape, _) in names.items()})
    return source, sum(t.numel() * t.element_size() for t in source.state_dict.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~31 MB, IPC and collective, seconds")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best; >= 3)")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    machine = Machine(repeats_for(args.quick, args.repeats))
    uptime = [_uptime()]
    print(f"uptime at start: {uptime[0]}")
    config = QUICK if args.quick else MID
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # --quick leaves HTTP out, and the test server with it (seconds to start).
        proc, url = (None, "") if args.quick else _start_server(config, Path(tmp), "--threads", "1")
        try:
            source, nbytes = _local_source(config) if proc is None else _random_source(url)
            runs: list[tuple[str, Callable[[], Coroutine[Any, Any, dict[str, float]]]]] = [
                ("ipc", lambda: _embedded(config, source, machine.repeats, "ipc")),
                ("collective", lambda: _embedded(config, source, machine.repeats, "collective")),
            ]
            if proc is not None:
                runs.append(("http", lambda: _http(url, source, machine.repeats)))
            for transport, run in runs:
                results[transport] = asyncio.run(run())
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    machine.finish()
    uptime.append(_uptime())

    table = Table(
        title=f"one sync, {nbytes / GB:.3f} GB bf16, {len(source.state_dict)} tensors, "
        f"buckets of {BUCKET_BYTES // 2**20} MiB",
        caption=machine.caption(),
    )
    for column in ("transport", "check", "s", "ratio to verify=False"):
        table.add_column(column, justify="left" if column in ("transport", "check") else "right")
    rows = []
    for transport, best in results.items():
        base = best[_label(False)]
        for check, seconds in best.items():
            ratio = seconds / base
            rows.append({"transport": transport, "check": check, "s": seconds, "ratio": ratio})
            table.add_row(transport, check, f"{seconds:.3f}", f"{ratio:.3f}")
    Console().print(table)
    full = {t: best[_label(True)] / best[_label(False)] for t, best in results.items()}
    for transport in ("ipc", "collective"):
        ratio = full[transport]
        verdict = "meets" if ratio <= FULL_GOAL else "misses"
        print(
            f"full verification (verify=True) on {transport}: {ratio:.3f}x an unverified "
            f"sync, {verdict} the goal <= {FULL_GOAL}"
        )
    print(f"uptime at start: {uptime[0]}")
    print(f"uptime at end:   {uptime[1]}")
    machine.report()
    if args.json:
        result = {
            "benchmark": "verify",
            "nbytes": nbytes,
            "tensors": len(source.state_dict),
            "bucket_bytes": BUCKET_BYTES,
            "rows": rows,
            "full_ratio": full,
            "full_goal": FULL_GOAL,
            "uptime": uptime,
            **machine.fields(),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
