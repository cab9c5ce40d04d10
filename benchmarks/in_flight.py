"""Generation while a non-colocated refit runs: throughput kept, and the pause window.

One embedded engine generates without a break (a few prompts at a time, greedy,
``ignore_eos``) while, in the same process, a trainer refits it over the
collective transport (gloo) again and again. Measured in the same run, for
each in-flight policy the table names (``staged`` overlap: the engine keeps
generating while the buckets land, and pauses only for the final copy):

* **baseline**: tokens per second with no refit, over ``--seconds`` seconds;
* **during refits**: tokens per second over the same time while a sync runs
  every ``--interval`` seconds (1: an optimizer step a second); the ratio to the
  baseline is what refitting costs generation (goal ≥ 0.95 for ``keep``:
  nothing waits but the copy into the live weights);
* **pause window**: the median ``pause_s`` of the COMMITTED events, ms — how long
  generation was held per refit.

On a 2-core CPU machine the refit's own copies compete with generation for the
cores, so the ratio measures that too; on GPUs the broadcast and the copies use
other resources than decoding. The baselines and the refit runs alternate, and
each figure is the best of ``--repeats`` (at least 3; 1 with ``--quick``); the
1-minute load average at start and end is recorded (``_machine``).

Usage::

    python benchmarks/in_flight.py            # a ~20 M-parameter Qwen3, 10 s windows
    python benchmarks/in_flight.py --quick    # the tiny Qwen3, 3 s windows (< 1 minute)
    python benchmarks/in_flight.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).parent))
from _machine import Machine, repeats_for
from _models import SMALL_QWEN3

from aiosync import (
    CollectiveOptions,
    EmbeddedEngine,
    SyncOptions,
    TrainCluster,
    VersionEventKind,
    WeightSynchronizer,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
POLICIES = ("keep", "wait")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _generate_for(engine: EmbeddedEngine, seconds: float, new_tokens: int) -> float:
    """Tokens per second generated back to back for ``seconds`` seconds."""
    tokens = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        outputs = await engine.generate(PROMPTS, max_new_tokens=new_tokens, ignore_eos=True)
        tokens += sum(len(o) for o in outputs)
    return tokens / (time.perf_counter() - start)


async def _during_refits(
    engine: EmbeddedEngine,
    sync: WeightSynchronizer,
    seconds: float,
    new_tokens: int,
    interval: float,
) -> tuple[float, list[float], int]:
    """Tokens per second while a sync runs every ``interval`` seconds; the pause
    windows (s); syncs done."""
    pauses: list[float] = []
    done = anyio.Event()
    rate = 0.0

    async def generate() -> None:
        nonlocal rate
        rate = await _generate_for(engine, seconds, new_tokens)
        done.set()

    async def refit() -> None:
        # One refit per "optimizer step" of ``interval`` seconds.
        while not done.is_set():
            await sync.mark_stale()
            await sync.sync_weights()
            with anyio.move_on_after(interval):
                await done.wait()

    async with sync.subscribe(max_backlog=100_000) as events:

        async def watch() -> None:
            async for event in events:
                if event.kind is VersionEventKind.COMMITTED:
                    pauses.append(event.pause_s)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as work:
                work.start_soon(generate)
                work.start_soon(refit)
            await anyio.sleep(0.05)  # the last COMMITTED reaches the watcher
            tg.cancel_scope.cancel()
    return rate, pauses, len(pauses)


async def _measure(
    config: dict[str, Any], seconds: float, repeats: int, new_tokens: int, interval: float
) -> dict[str, Any]:
    trainer = HFModelRunner.from_config(dict(config), seed=1)
    results: dict[str, Any] = {}
    async with EmbeddedEngine(dict(config), num_workers=1, seed=2) as engine:
        await _generate_for(engine, 1.0, new_tokens)  # warm-up
        baselines: list[float] = []
        for policy in POLICIES:
            sync = create_weight_synchronizer(
                DTensorRefitSource(trainer.model),
                engine,
                colocated=False,
                backend="embedded",
                train_cluster=TrainCluster(master_port=_port()),
                inference_world_size=1,
                transport=CollectiveOptions(overlap="staged"),
                sync=SyncOptions(in_flight=policy),
            )
            async with sync:
                await sync.init_communicator()
                rates: list[float] = []
                pauses: list[float] = []
                syncs = 0
                for _ in range(repeats):
                    baselines.append(await _generate_for(engine, seconds, new_tokens))
                    rate, windows, count = await _during_refits(
                        engine, sync, seconds, new_tokens, interval
                    )
                    rates.append(rate)
                    pauses += windows
                    syncs += count
            results[policy] = {
                "tokens_per_s": round(max(rates), 2),
                "pause_ms_median": round(1e3 * statistics.median(pauses), 2) if pauses else None,
                "syncs": syncs,
            }
        baseline = max(baselines)
        for row in results.values():
            row["ratio"] = round(row["tokens_per_s"] / baseline, 3)
        return {
            "baseline_tokens_per_s": round(baseline, 2),
            "interval_s": interval,
            "policies": results,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 s windows")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--seconds", type=float, default=None, help="window length, s")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refits (a training step)"
    )
    args = parser.parse_args()
    repeats = repeats_for(args.quick, args.repeats)
    config = TINY_QWEN3 if args.quick else SMALL_QWEN3
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    new_tokens = 8 if args.quick else 16
    machine = Machine(repeats)
    figures = anyio.run(_measure, config, seconds, repeats, new_tokens, args.interval)
    machine.finish()
    model = "tiny Qwen3" if args.quick else "Qwen3, hidden 512, 4 layers"
    print(f"generation during collective refits (staged) every {args.interval:g} s, {model}")
    print(f"{'policy':<10}{'tokens/s':>12}{'/ no refit':>12}{'pause ms':>12}{'syncs':>8}")
    print(f"{'no refit':<10}{figures['baseline_tokens_per_s']:>12.1f}{1.0:>12.2f}{'-':>12}{0:>8}")
    for policy, row in figures["policies"].items():
        pause = "-" if row["pause_ms_median"] is None else f"{row['pause_ms_median']:.1f}"
        print(
            f"{policy:<10}{row['tokens_per_s']:>12.1f}{row['ratio']:>12.2f}{pause:>12}"
            f"{row['syncs']:>8}"
        )
    machine.report()
    if args.json:
        print(json.dumps({"benchmark": "in_flight", **figures, **machine.fields()}))


if __name__ == "__main__":
    main()
