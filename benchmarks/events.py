"""Event fan-out latency: 1,000 subscribers reading the weight-version stream while syncs run.

Latency is measured from the moment an event is published (its ``timestamp``)
to the moment each subscriber task receives it. The baseline is the same
fan-out over bare anyio memory object streams (one per subscriber), measured in
the same process, so the ratio shows what the event hub adds. Each side runs
``--repeats`` times (at least 3; 2 when ``--quick``) and the run with the lowest
p99 is kept; the 1-minute load average at start and end is recorded (``_machine``).

    python benchmarks/events.py [--quick] [--json] [--subscribers N] [--syncs N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import anyio
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table

from aiosync import KVScales, RefitSource, VersionEventKind, WeightSynchronizer


class _Source(RefitSource):
    def prepare_refit_info(self) -> dict[str, Any]:
        return {}

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        return iter(())


class _YieldingSync(WeightSynchronizer):
    """A transfer that yields to the event loop once, like any real await would."""

    async def _transfer(self, version: int, kv_scales: KVScales | None) -> int:
        await anyio.sleep(0)
        return 1 << 20


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _aiosync_fanout(subscribers: int, syncs: int) -> dict[str, float]:
    sync = _YieldingSync(_Source(), None)
    await sync.init_communicator()
    latencies: list[float] = []
    publish: list[float] = []
    received = 0
    overflows = 0

    async def consume(events: Any) -> None:
        nonlocal received, overflows
        async for ev in events:
            if ev.kind is VersionEventKind.OVERFLOW:
                overflows += ev.missed
                continue
            latencies.append(time.time() - ev.timestamp)
            received += 1

    subs = [sync.subscribe() for _ in range(subscribers)]
    async with anyio.create_task_group() as tg:
        for s in subs:
            tg.start_soon(consume, s)
        await anyio.sleep(0)
        start = time.perf_counter()
        for _ in range(syncs):
            t0 = time.perf_counter()
            await sync.mark_stale()  # publishes to every subscriber without waiting
            publish.append(time.perf_counter() - t0)
            await sync.sync_weights()
            await anyio.sleep(0)
        elapsed = time.perf_counter() - start
        await sync.shutdown()
    expected = 3 * syncs * subscribers
    return {
        "p50_ms": 1e3 * _percentile(latencies, 0.50),
        "p99_ms": 1e3 * _percentile(latencies, 0.99),
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "received": received,
        "lost": expected - received - overflows,
        "overflowed": overflows,
        "syncs_per_s": syncs / elapsed,
        "publish_p99_ms": 1e3 * _percentile(publish, 0.99),
    }


async def _baseline_fanout(subscribers: int, syncs: int) -> dict[str, float]:
    latencies: list[float] = []
    received = 0
    pairs = [anyio.create_memory_object_stream[float](1024) for _ in range(subscribers)]

    async def consume(receive: Any) -> None:
        nonlocal received
        async with receive:
            async for stamp in receive:
                latencies.append(time.time() - stamp)
                received += 1

    async with anyio.create_task_group() as tg:
        for _, receive in pairs:
            tg.start_soon(consume, receive)
        await anyio.sleep(0)
        start = time.perf_counter()
        for _ in range(syncs):
            for _ in range(3):
                stamp = time.time()
                for send, _ in pairs:
                    send.send_nowait(stamp)
                await anyio.sleep(0)
        elapsed = time.perf_counter() - start
        for send, _ in pairs:
            send.close()
    return {
        "p50_ms": 1e3 * _percentile(latencies, 0.50),
        "p99_ms": 1e3 * _percentile(latencies, 0.99),
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "received": received,
        "lost": 3 * syncs * subscribers - received,
        "overflowed": 0,
        "syncs_per_s": syncs / elapsed,
    }


def _best_run(fanout: Any, subscribers: int, syncs: int, repeats: int) -> dict[str, float]:
    """The run with the lowest p99 of ``repeats`` full fan-out runs (each a fresh loop)."""
    runs = [anyio.run(fanout, subscribers, syncs) for _ in range(repeats)]
    return min(runs, key=lambda r: r["p99_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--syncs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 syncs, 2 repeats")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (lowest p99 kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    syncs = 20 if args.quick else args.syncs
    machine = Machine(repeats_for(args.quick, args.repeats))

    ours = _best_run(_aiosync_fanout, args.subscribers, syncs, machine.repeats)
    base = _best_run(_baseline_fanout, args.subscribers, syncs, machine.repeats)
    machine.finish()

    table = Table(
        title=f"event fan-out to {args.subscribers} subscribers, {syncs} syncs",
        caption=machine.caption("lowest p99"),
    )
    for col in ("stream", "p50 ms", "p99 ms", "mean ms", "received", "lost", "syncs/s"):
        table.add_column(col, justify="right")
    for name, r in (("aiosync hub", ours), ("bare memory streams", base)):
        table.add_row(
            name,
            f"{r['p50_ms']:.3f}",
            f"{r['p99_ms']:.3f}",
            f"{r['mean_ms']:.3f}",
            str(r["received"]),
            str(r["lost"]),
            f"{r['syncs_per_s']:.0f}",
        )
    console = Console()
    console.print(table)
    ratio = ours["p99_ms"] / base["p99_ms"] if base["p99_ms"] > 0 else float("nan")
    console.print(
        f"p99 ratio hub/baseline: {ratio:.2f}x   goal: p99 < 1 ms "
        f"({'met' if ours['p99_ms'] < 1 else 'missed'}), none lost ({ours['lost']} lost)"
    )
    console.print(
        f"publishing one event to all {args.subscribers} subscribers (what a sync waits for): "
        f"p99 {ours['publish_p99_ms']:.3f} ms; the delivery latency above is the event loop "
        "waking every subscriber task, the same floor the baseline pays"
    )
    if (warning := machine.warning()) is not None:
        console.print(warning, soft_wrap=True)  # one line, for grep
    if args.json:
        print(
            json.dumps(
                {
                    "subscribers": args.subscribers,
                    "syncs": syncs,
                    "aiosync": ours,
                    "baseline": base,
                    "p99_ratio": ratio,
                    **machine.fields(),
                }
            )
        )


if __name__ == "__main__":
    main()
