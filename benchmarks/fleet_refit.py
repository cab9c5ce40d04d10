"""A fleet that keeps generating through every refit: rolling against stop-the-world.

Four embedded engines behind one :class:`~aiosync.EngineFleet` generate without a
break (back-to-back ``generate`` calls of one short prompt per engine, greedy,
``ignore_eos``) while, in the same process, a trainer refits them over IPC every
``--interval`` seconds (an optimizer step). Measured in one run, on the same engines:

* **no refit**: the fleet's tokens per second with no sync: the baseline;
* **all**: ``refit="all"`` (stop the world: every engine pauses for each sync);
* **rolling**: ``refit="rolling", max_unavailable=1`` (waves of one engine while the
  other three serve);
* **rolling+peer**: the same with ``wave_source="peer"``: waves after the first copy the
  version from an engine that committed it, so the trainer sends one copy per sync.

For each: tokens per second over the whole window and inside the refit windows (each
``generate`` call's tokens spread evenly over its span, the share that falls between a
sync's start and its commit, over those windows' length), each as a ratio to the
baseline (goal for rolling inside the window: >= 0.95 x (N-k)/N); the longest any
call waited (ms); the longest stretch with no call returning (ms: the fleet's longest
stall); the trainer's
bytes per sync (``COMMITTED.nbytes``). Each figure is the best of ``--repeats`` (at
least 3; 1 with ``--quick``), the modes alternating; the 1-minute load average at
start and end is recorded (``_machine``). On a 2-core machine the four engines and the
trainer share the cores: a paused engine's core goes to the others, which favours
rolling here more than on GPUs, where each engine has its own.

Usage::

    python benchmarks/fleet_refit.py            # a ~20 M-parameter Qwen3, 8 s windows
    python benchmarks/fleet_refit.py --quick    # the tiny Qwen3, 2 s windows (seconds)
    python benchmarks/fleet_refit.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _machine import Machine, repeats_for
from _models import SMALL_QWEN3

from aiosync import (
    EmbeddedEngine,
    EngineFleet,
    IPCOptions,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource

ENGINES = 4
MODES = ("all", "rolling", "rolling+peer")


class Window:
    """One measured window: when each generate call returned, its tokens, its wait."""

    def __init__(self) -> None:
        self.returns: list[tuple[float, int]] = []
        self.calls: list[tuple[float, float, int]] = []
        self.longest_wait = 0.0
        self.refits: list[tuple[float, float]] = []
        self.nbytes: list[int] = []

    def figures(self, start: float, end: float) -> dict[str, float]:
        tokens = sum(n for _, n in self.returns)
        # A call's tokens spread evenly over its span: the share inside refit windows.
        inside = sum(
            n * sum(max(0.0, min(b, end) - max(a, begin)) for a, b in self.refits) / (end - begin)
            for begin, end, n in self.calls
        )
        refit_s = sum(b - a for a, b in self.refits)
        times = [start, *(t for t, _ in self.returns), end]
        return {
            "tokens_per_s": tokens / (end - start),
            "refit_tokens_per_s": inside / refit_s if refit_s else float("nan"),
            "longest_wait_ms": 1e3 * self.longest_wait,
            "longest_stall_ms": 1e3 * max(b - a for a, b in itertools.pairwise(times)),
            "syncs": len(self.refits),
            "mb_per_sync": (sum(self.nbytes) / len(self.nbytes) / 1e6) if self.nbytes else 0.0,
        }


async def _window(
    fleet: EngineFleet,
    sync: Any,
    trainer: torch.nn.Module,
    seconds: float,
    interval: float,
    new_tokens: int,
) -> dict[str, float]:
    """Generate for ``seconds`` while (``sync`` not None) a sync runs every ``interval``."""
    window = Window()
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(ENGINES)]
    done = anyio.Event()
    start = time.perf_counter()

    async def generate() -> None:
        while time.perf_counter() - start < seconds:
            called = time.perf_counter()
            out = await fleet.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
            now = time.perf_counter()
            window.returns.append((now, sum(len(o) for o in out)))
            window.calls.append((called, now, sum(len(o) for o in out)))
            window.longest_wait = max(window.longest_wait, now - called)
        done.set()

    async def refit() -> None:
        while not done.is_set():
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1e-3)
            await sync.mark_stale()
            began = time.perf_counter()
            await sync.sync_weights()
            window.refits.append((began, time.perf_counter()))
            with anyio.move_on_after(interval):
                await done.wait()

    async def watch(events: Any) -> None:
        async for event in events:
            if event.kind is VersionEventKind.COMMITTED:
                window.nbytes.append(event.nbytes)

    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
        if sync is not None:
            events = await stack.enter_async_context(sync.subscribe(max_backlog=100_000))
            tg.start_soon(watch, events)
        async with anyio.create_task_group() as work:
            work.start_soon(generate)
            if sync is not None:
                work.start_soon(refit)
        await anyio.sleep(0.05)  # the last COMMITTED reaches the watcher
        tg.cancel_scope.cancel()
    return window.figures(start, time.perf_counter())


async def _measure(
    config: dict[str, Any], seconds: float, repeats: int, new_tokens: int, interval: float
) -> dict[str, Any]:
    trainer = HFModelRunner.from_config(dict(config), seed=1)
    engines = [EmbeddedEngine(dict(config), num_workers=1, seed=2) for _ in range(ENGINES)]
    for engine in engines:
        await engine.start()
    try:
        fleets = {
            "all": EngineFleet(engines),
            "rolling": EngineFleet(engines, refit="rolling", max_unavailable=1),
            "rolling+peer": EngineFleet(
                engines, refit="rolling", max_unavailable=1, wave_source="peer"
            ),
        }
        syncs = {
            mode: create_weight_synchronizer(
                DTensorRefitSource(trainer.model),
                fleet,
                colocated=True,
                backend="embedded",
                transport=IPCOptions(device="cpu"),
            )
            for mode, fleet in fleets.items()
        }
        await _window(fleets["all"], None, trainer.model, 1.0, interval, new_tokens)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {"none": [], **{m: [] for m in MODES}}
        for _ in range(repeats):
            runs["none"].append(
                await _window(fleets["all"], None, trainer.model, seconds, interval, new_tokens)
            )
            for mode in MODES:
                sync = syncs[mode]
                await sync.init_communicator()  # takes the engines over from the other mode
                runs[mode].append(
                    await _window(fleets[mode], sync, trainer.model, seconds, interval, new_tokens)
                )
        for sync in syncs.values():
            await sync.shutdown()
    finally:
        for engine in engines:
            await engine.shutdown()
    baseline = max(r["tokens_per_s"] for r in runs["none"])
    rows: dict[str, dict[str, Any]] = {}
    for mode, figures in runs.items():
        best = max(figures, key=lambda r: r["tokens_per_s"])
        rows[mode] = {
            "tokens_per_s": round(best["tokens_per_s"], 1),
            "ratio": round(best["tokens_per_s"] / baseline, 3),
            "refit_ratio": None
            if mode == "none"
            else round(max(r["refit_tokens_per_s"] for r in figures) / baseline, 3),
            "longest_wait_ms": round(min(r["longest_wait_ms"] for r in figures), 1),
            "longest_stall_ms": round(min(r["longest_stall_ms"] for r in figures), 1),
            "syncs": int(sum(r["syncs"] for r in figures)),
            "mb_per_sync": round(best["mb_per_sync"], 2),
        }
    return {
        "engines": ENGINES,
        "max_unavailable": 1,
        "rolling_goal": round(0.95 * (ENGINES - 1) / ENGINES, 3),
        "baseline_tokens_per_s": round(baseline, 1),
        "interval_s": interval,
        "modes": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 s windows")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--seconds", type=float, default=None, help="window length, s")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refits (a training step)"
    )
    args = parser.parse_args()
    repeats = repeats_for(args.quick, args.repeats)
    config = TINY_QWEN3 if args.quick else SMALL_QWEN3
    seconds = args.seconds or (2.0 if args.quick else 8.0)
    new_tokens = 4 if args.quick else 8
    machine = Machine(repeats)
    figures = anyio.run(_measure, config, seconds, repeats, new_tokens, args.interval)
    machine.finish()
    model = "tiny Qwen3" if args.quick else "Qwen3, hidden 512, 4 layers"
    print(
        f"a fleet of {ENGINES} embedded engines generating while IPC refits it every "
        f"{args.interval:g} s, {model}"
    )
    print(
        f"{'refit':<13}{'tokens/s':>10}{'/ none':>8}{'in refit':>10}{'wait ms':>10}"
        f"{'stall ms':>10}{'syncs':>7}{'MB/sync':>9}"
    )
    for mode, row in figures["modes"].items():
        inside = "-" if row["refit_ratio"] is None else f"{row['refit_ratio']:.2f}"
        print(
            f"{mode:<13}{row['tokens_per_s']:>10.1f}{row['ratio']:>8.2f}{inside:>10}"
            f"{row['longest_wait_ms']:>10.1f}{row['longest_stall_ms']:>10.1f}{row['syncs']:>7}"
            f"{row['mb_per_sync']:>9.2f}"
        )
    print(
        f"'in refit': tokens/s inside the refit windows / no refit (rolling goal >= "
        f"{figures['rolling_goal']}); wait: the longest generate call; stall: the longest "
        "time no call returned"
    )
    machine.report()
    if args.json:
        print(json.dumps({"benchmark": "fleet_refit", **figures, **machine.fields()}))


if __name__ == "__main__":
    main()
