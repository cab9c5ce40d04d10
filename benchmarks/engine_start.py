"""Time to a ready embedded engine, against the cost of importing torch.

An :class:`~aiosync.EmbeddedEngine` worker is a process of its own. Started by
``spawn`` it imports torch and transformers afresh; started by the engine's
forkserver (``aiosync.engines.embedded._pool.worker_context``) it is a fork of a
warm interpreter that imported them once. Measured in one run, best of the
repeats, seconds of wall time:

* ``import torch`` (baseline): ``python -c "import torch"`` in a bare
  interpreter, start to exit;
* ``1 worker``: ``EmbeddedEngine(tiny Qwen3).start()`` to ready (each repeat a
  new engine; the forkserver, once started by the warm-up, stays);
* ``TP=2``: the same with ``tensor_parallel_size=2`` (two ranks and their gloo
  group);
* ``respawn``: a worker SIGKILLed, :meth:`~aiosync.EmbeddedEngine.respawn_dead_workers`
  until the new one is ready;
* ``forkserver start``: the first engine of a process, which also starts the
  forkserver (its preload: torch, transformers, the worker);
* ``1 worker, spawn``: the 1-worker engine with the workers ``spawn``ed, as
  before the forkserver: what every start cost then.

Ratios are to ``import torch``: below 1, an engine is ready sooner than a bare
interpreter imports torch.

Usage::

    python benchmarks/engine_start.py            # 3 repeats
    python benchmarks/engine_start.py --quick    # 1 repeat, seconds
    python benchmarks/engine_start.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _machine import Machine, repeats_for

#: A tiny Qwen3 (builds in milliseconds): what is measured is the process start.
MODEL = {
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def _import_torch_s() -> float:
    """Seconds for a bare interpreter to import torch and exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


async def _timed(step: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await step()
    return time.perf_counter() - start


async def _engine_start_s(**options: Any) -> float:
    """Seconds from ``start()`` to ready for a new engine (shut down after)."""
    from aiosync import EmbeddedEngine

    engine = EmbeddedEngine(MODEL, **options)
    try:
        return await _timed(engine.start)
    finally:
        await engine.shutdown()


async def _respawn_s() -> float:
    """Seconds to replace a SIGKILLed worker of a running 1-worker engine."""
    from aiosync import EmbeddedEngine, TransportError

    async with EmbeddedEngine(MODEL) as engine:
        os.kill(engine.pids[0], signal.SIGKILL)
        # The engine learns of the death from the process's sentinel, on the loop.
        while True:
            try:
                await engine.check_health()
            except TransportError:
                break
            await asyncio.sleep(0.01)
        return await _timed(engine.respawn_dead_workers)


async def _measure(repeats: int) -> dict[str, list[float]]:
    from aiosync.engines.embedded import _pool

    samples: dict[str, list[float]] = {}
    samples["forkserver start"] = [await _engine_start_s()]  # also the warm-up
    for _ in range(repeats):
        samples.setdefault("import torch", []).append(_import_torch_s())
        samples.setdefault("1 worker", []).append(await _engine_start_s())
        samples.setdefault("TP=2", []).append(await _engine_start_s(tensor_parallel_size=2))
        samples.setdefault("respawn", []).append(await _respawn_s())
    # The comparison with the start method before the forkserver: the benchmark
    # swaps the pool's context (a private seam, used here alone).
    forkserver = _pool.worker_context
    _pool.worker_context = lambda: multiprocessing.get_context("spawn")
    try:
        samples["1 worker, spawn"] = [await _engine_start_s() for _ in range(repeats)]
    finally:
        _pool.worker_context = forkserver
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each (>= 3)")
    parser.add_argument("--quick", action="store_true", help="one repeat, seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    repeats = repeats_for(args.quick, args.repeats)
    machine = Machine(repeats)
    samples = asyncio.run(_measure(repeats))
    machine.finish()
    best = {name: min(values) for name, values in samples.items()}
    baseline = best["import torch"]
    ratios = {name: round(seconds / baseline, 3) for name, seconds in best.items()}
    _print_table(best, ratios, machine)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "engine_start",
                    "seconds": {name: round(s, 4) for name, s in best.items()},
                    "ratio_to_import_torch": ratios,
                    **machine.fields(),
                }
            )
        )


def _print_table(best: dict[str, float], ratios: dict[str, float], machine: Machine) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="time to a ready embedded engine (tiny Qwen3, CPU)", caption=machine.caption()
    )
    for column in ("start", "seconds", "/ import torch"):
        table.add_column(column, justify="right")
    for name, seconds in best.items():
        table.add_row(name, f"{seconds:.3f}", f"{ratios[name]:.2f}x")
    Console().print(table)
    if (warning := machine.warning()) is not None:
        print(warning)


if __name__ == "__main__":
    main()
