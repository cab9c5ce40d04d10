"""Fixed cost of one colocated sync: one 4 KiB tensor over IPC into the embedded engine.

With so few bytes, the copy is nothing and what is left is the protocol: the
time a sync costs whatever the model. Measured in the same run, each sync
interleaved with one RPC (so a change of load hits both alike), the ``sync``
samples first, then the ``sync_awake`` ones (a worker keeps its connection
and buffer mappings for one synchronizer at a time: alternating two would
reconnect every sync):

* ``sync``: ``IPCWeightSynchronizer.sync_weights()`` of one bf16 tensor of
  4 KiB (2,048 elements) into a one-worker :class:`~aiosync.EmbeddedEngine`
  (the weights-only ``FlatModel`` of ``benchmarks/ipc.py``) that does not say
  what sleeps (:class:`SilentSleepEngine`: woken around every sync, as an
  engine without ``asleep_tags``), after a warm-up sync; ``mark_stale()``
  before each, outside the timing.
* ``sync_awake``: the same into the engine itself, which reports
  ``asleep_tags`` (what it put to sleep, kept locally): the synchronizer skips
  the two wake RPCs of an awake engine.
* ``rpc``: one ``engine.collective_rpc("embedded_status")`` round trip, the
  floor of any engine RPC (msgpack over the engine's ZMQ socket; the worker's
  main thread runs it itself, ``engines/embedded/_worker.py``).
* ``zmq_rtt`` (baseline): one bare pyzmq round trip of a 64-byte message, the
  engine's socket kinds over the same transport: a blocking ``ROUTER`` bound
  on ``ipc://`` in this process, a blocking ``DEALER`` echoing it in a child
  process (``python -c``), no asyncio, no msgpack, no thread hop. What any
  engine RPC here cannot go below.

Each sample is one ``zmq_rtt``, one ``rpc`` and one sync, one after the
other (so a change of load hits all three alike). Best, median and p90 of
``--syncs`` samples each (50; ``--quick``: 10), in ms, and the ratios of the
medians to rpc and to zmq_rtt.

Process round trips per sync, read from the code (``synchronizer.py``'s
``WeightSynchronizer.sync_weights``, ``transports/ipc/synchronizer.py``,
``transports/ipc/worker.py``, ``engines/embedded/engine.py``), one trainer
rank, one worker, one bucket, engine idle, one after the other:

1. ``pause_generation("wait")`` (base class): no RPC while none of the engine
   object's generate calls runs (it alone sends the workers requests, so it
   closes admission itself; with requests running it is the
   ``embedded_pause_generation`` RPC);
2. ``prepare_for_generation(tags=["weights"])`` → ``embedded_wake``: 1 RPC,
   skipped when the engine's ``asleep_tags`` says the weights are awake;
3. ``aiosync_ipc_receive``: one manifest of 4 KiB to one worker from one
   trainer rank is an inline sync (``transports/ipc/synchronizer.py``): the
   trainer packs the bucket first and its ``data`` and ``end`` messages ride in
   the RPC request; the worker loads them without touching its ZMQ DEALER and its
   RPC reply is the ``done``: 2 serial messages. (Before, over the DEALER it keeps
   connected to the trainer's ROUTER: ``hello`` (worker → trainer), ``data`` →
   ``ack`` per bucket, ``end`` → ``done``: 6. ``end`` commits, so with several
   workers it still waits for every worker's acks: sent earlier, one engine of a
   fleet committed while another was dying mid-bucket (tests/fleet caught it).)
4. ``prepare_for_generation(tags=["kv_cache"])`` → ``embedded_wake``: 1 RPC,
   skipped as 2.;
5. ``on_weights_committed(version)`` (base class): no RPC while paused (the
   version travels with the next request, or with the resume of frozen ones);
6. ``resume_generation()`` (base class): no RPC unless the workers were paused.

That is 3 engine RPCs and 6 serial one-way messages (3 round trips), or,
with ``asleep_tags``, 1 RPC and 2 messages (1 round trip; 6 and 3 before inline
syncs). An engine RPC that may wait (a wake of what sleeps, a streamed receive, a generate)
hops to a thread of the worker's RPC pool and back; a brief one (``embedded_status``, an inline
receive, a wake while nothing sleeps) runs on the worker's main thread while the pool is idle,
with no hop (~0.05-0.1 ms each way here). The
trainer reads the source and packs an inline refit of at most 1 MiB on the event loop (a
thread hop cost ~0.45 ms here, more than the copy), a bigger one in one thread hop per bucket
(three before issue 16: read, pack, check the source ended), and the no-op offload hooks of
``RefitSource`` run without a hop. A ratio to
rpc near the round trips means the protocol costs what its messages do and
nothing else. (Until the embedded engine kept an idle pause to itself, the
base class's pause, version label and resume were an RPC each: 6 RPCs and 16 messages, 4 and 12
with ``asleep_tags``; before issue 16 the docstring counted 3 RPCs and 11
messages, predating them.)

Measured (issue 43 item 7; ``python benchmarks/fixed_cost.py --syncs 200 --json``, the code
before, commit 9f49417, run with ``PYTHONPATH`` at its tree, alternating with the code after;
medians in ms, the 2-CPU machine shared, 1-minute load at start -> end)::

    zmq_rtt  rpc    sync   sync_awake   load
    0.086    0.530  2.272  1.364        9.5 -> 10.0    before
    0.068    0.111  1.506  0.831        10.1 -> 10.6   after
    0.119    0.578  2.795  1.476        2.2 -> 2.3     before
    0.065    0.153  1.281  0.892        2.3 -> 2.3     after
    0.100    0.527  2.673  1.359        10.2 -> 10.6   before
    0.068    0.102  1.164  0.732        10.9 -> 11.6   after
    0.116    0.546  4.505  2.710        11.8 -> 12.0   before
    0.155    0.141  1.445  0.893        11.9 -> 12.9   after

One RPC went from ~5x a bare round trip to ~1.5x (0.53 -> 0.10-0.15 ms), an awake sync from
1.36-2.71 to 0.73-0.89 ms, a woken one (3 RPCs) from 2.3-4.5 to 1.2-1.5 ms. The load never fell
below 2 per 2 CPUs while this was measured: on an idle machine every figure is lower.

Where an awake sync's time goes now (a timeline of one sync's phases, ``time.monotonic()`` on
both sides, median of 1,000, load ~5, 0.79 ms in all): the core's ``sync_weights`` around the
transport (lock, events, the colocated bracket, runtime ``Protocol`` checks: 11
``isinstance`` against ``typing`` protocols, ~11 anyio cancel scopes, commit and ownership) ~0.25
ms; the trainer's read, pack and digest of the 4 KiB bucket (``send_lanes``) ~0.13 ms; the RPC
there and back with its 4 KiB session (pyzmq, msgpack, the loop's wake) ~0.17 ms; the worker's
receive (claim, plan, unpack, load, digest check) ~0.15 ms. What the changes took out: pyzmq's
asyncio sockets on both sides (a poll future, a selector registration and a wait per message:
an RPC was 0.5 ms where a bare round trip is 0.07) and the worker's thread hop each way (~0.13 ms
in, ~0.07 ms out, under load), an anyio cancel scope per RPC, a task group per inline sync.
Left, and why 0.5 ms is not reached here: the core's share (``aiosync/synchronizer.py``; a
sync whose ``_transfer`` only runs the colocated bracket takes 0.21 ms at load 12: each
``isinstance`` against a runtime protocol costs 14-25 us here, Python 3.11 recomputing the
protocol's members on every check, and each anyio ``fail_after`` 28 us), and the CPU the two
processes spend in Python per sync (trainer ~0.5 ms, worker ~0.25 ms of CPU time, read from
``/proc``), in series on two shared cores.

Usage::

    python benchmarks/fixed_cost.py            # 50 syncs
    python benchmarks/fixed_cost.py --quick    # 10 syncs, < 1 minute
    python benchmarks/fixed_cost.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import zmq
from _machine import Machine
from ipc import FlatModel, FlatSource  # the weights-only model and source of the IPC benchmark

#: One bf16 tensor of 4 KiB: 2,048 elements of 2 bytes.
SPEC = {"count": 1, "numel": 2048}
TENSOR_BYTES = SPEC["count"] * SPEC["numel"] * 2
#: Staging buffer, bytes (1 MiB; the default would take 2 % of the free memory).
BUCKET_BYTES = 1 << 20
#: Engine RPCs per sync (see the module docs): an engine without ``asleep_tags``,
#: and one that reports it is awake.
RPCS_PER_SYNC = 3
RPCS_PER_SYNC_AWAKE = 1
#: Serial one-way messages between trainer and worker per sync (see the module docs).
MESSAGES_PER_SYNC = 6
MESSAGES_PER_SYNC_AWAKE = 2
#: ... as round trips, the unit the RPC baseline measures.
ROUND_TRIPS_PER_SYNC = MESSAGES_PER_SYNC / 2
ROUND_TRIPS_PER_SYNC_AWAKE = MESSAGES_PER_SYNC_AWAKE / 2
#: The bare round trip's message, bytes (about an ``embedded_status`` request's size).
ZMQ_RTT_BYTES = 64
#: The echo end of the bare round trip: a blocking DEALER in a child process.
_ECHO = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
sock.send(b"ready")
while (msg := sock.recv()) != b"stop":
    sock.send(msg)
sock.close()
ctx.term()
"""


class PointModel(FlatModel):
    """:class:`FlatModel` with the ``kv_scales`` that ``embedded_status`` reports."""

    def __init__(self, spec: Any, *, seed: int = 0, dtype: str = "bfloat16") -> None:
        super().__init__(spec, seed=seed, dtype=dtype)
        self.kv_scales: dict[str, float] = {}


class SilentSleepEngine:
    """An :class:`~aiosync.EmbeddedEngine` that does not say what sleeps
    (``asleep_tags = None``), as an engine without the attribute: the
    synchronizer then wakes it around every sync. Everything else is the engine's."""

    asleep_tags = None

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class BareRoundTrip:
    """A bare pyzmq round trip (``zmq_rtt``): a blocking ROUTER bound on ``ipc://``
    here, a blocking DEALER echoing each message in a child process."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="aiosync-bench-rtt-")
        endpoint = f"ipc://{self._dir}/rtt.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._child = subprocess.Popen([sys.executable, "-c", _ECHO, endpoint])
        self._peer, _ready = self._sock.recv_multipart()
        self._message = b"x" * ZMQ_RTT_BYTES

    def sample(self) -> float:
        """One round trip, seconds."""
        start = time.perf_counter()
        self._sock.send_multipart([self._peer, self._message])
        self._sock.recv_multipart()
        return time.perf_counter() - start

    def close(self) -> None:
        self._sock.send_multipart([self._peer, b"stop"])
        self._child.wait(10)
        self._sock.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(samples: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(sync seconds, sync_awake seconds, rpc seconds, zmq_rtt seconds)``: ``samples``
    syncs of each kind, one kind after the other, each sync interleaved with one
    bare round trip and one RPC."""
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
    awake: list[float] = []
    rpcs: list[float] = []
    rtts: list[float] = []
    bare = BareRoundTrip()
    # A small staging buffer: its size changes the memory taken at init, not a sync's cost.
    sync = IPCWeightSynchronizer(source, SilentSleepEngine(engine), bucket_bytes=BUCKET_BYTES)
    sync_awake = IPCWeightSynchronizer(source, engine, bucket_bytes=BUCKET_BYTES)
    try:
        async with engine, sync, sync_awake:
            # One synchronizer after the other, not alternating: a worker keeps its
            # connection and buffer mappings for one synchronizer at a time.
            for each, out in ((sync, syncs), (sync_awake, awake)):
                await each.init_communicator()
                for _ in range(3):  # warm-up: maps the shared buffers, connects, caches
                    bare.sample()
                    await each.mark_stale()
                    await each.sync_weights()
                    await engine.collective_rpc("embedded_status")
                for _ in range(samples):
                    rtts.append(bare.sample())
                    start = time.perf_counter()
                    await engine.collective_rpc("embedded_status")
                    rpcs.append(time.perf_counter() - start)
                    await each.mark_stale()
                    start = time.perf_counter()
                    await each.sync_weights()
                    out.append(time.perf_counter() - start)
    finally:
        bare.close()
    return syncs, awake, rpcs, rtts


def _summary(seconds: list[float]) -> dict[str, float]:
    """Best, median and p90, ms."""
    return {
        "best_ms": round(1e3 * min(seconds), 4),
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
    sync_s, awake_s, rpc_s, rtt_s = asyncio.run(_measure(samples))
    machine.finish()
    sync, awake, rpc = _summary(sync_s), _summary(awake_s), _summary(rpc_s)
    rtt = _summary(rtt_s)
    ratio = round(sync["median_ms"] / rpc["median_ms"], 3)
    ratio_awake = round(awake["median_ms"] / rpc["median_ms"], 3)
    vs_rtt = {
        name: round(each["median_ms"] / rtt["median_ms"], 3)
        for name, each in (("rpc", rpc), ("sync", sync), ("sync_awake", awake))
    }
    _print_table(sync, awake, rpc, rtt, ratio, ratio_awake, vs_rtt, machine)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "fixed_cost",
                    "tensor_bytes": TENSOR_BYTES,
                    "sync": sync,
                    "sync_awake": awake,
                    "rpc": rpc,
                    "zmq_rtt": rtt,
                    "zmq_rtt_bytes": ZMQ_RTT_BYTES,
                    "ratio_sync_vs_rpc": ratio,
                    "ratio_sync_awake_vs_rpc": ratio_awake,
                    "ratio_rpc_vs_zmq_rtt": vs_rtt["rpc"],
                    "ratio_sync_vs_zmq_rtt": vs_rtt["sync"],
                    "ratio_sync_awake_vs_zmq_rtt": vs_rtt["sync_awake"],
                    "rpcs_per_sync": RPCS_PER_SYNC,
                    "rpcs_per_sync_awake": RPCS_PER_SYNC_AWAKE,
                    "round_trips_per_sync": ROUND_TRIPS_PER_SYNC,
                    "round_trips_per_sync_awake": ROUND_TRIPS_PER_SYNC_AWAKE,
                    "messages_per_sync": MESSAGES_PER_SYNC,
                    "messages_per_sync_awake": MESSAGES_PER_SYNC_AWAKE,
                    **machine.fields(),
                }
            )
        )


def _print_table(
    sync: dict[str, float],
    awake: dict[str, float],
    rpc: dict[str, float],
    rtt: dict[str, float],
    ratio: float,
    ratio_awake: float,
    vs_rtt: dict[str, float],
    machine: Machine,
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"fixed cost of one IPC sync ({TENSOR_BYTES} B tensor, embedded engine, 1 worker)",
        caption=machine.caption("best, median, p90"),
    )
    for column in ("measure", "best ms", "median ms", "p90 ms", "/ zmq_rtt", "/ rpc", "trips"):
        table.add_column(column, justify="right")

    def times(each: dict[str, float]) -> tuple[str, str, str]:
        return f"{each['best_ms']:.3f}", f"{each['median_ms']:.3f}", f"{each['p90_ms']:.3f}"

    table.add_row("zmq_rtt", *times(rtt), "1", "", "1")
    table.add_row("rpc", *times(rpc), f"{vs_rtt['rpc']:.1f}x", "1", "1")
    table.add_row(
        "sync",
        *times(sync),
        f"{vs_rtt['sync']:.1f}x",
        f"{ratio:.2f}x",
        f"{ROUND_TRIPS_PER_SYNC:g}",
    )
    table.add_row(
        "sync_awake",
        *times(awake),
        f"{vs_rtt['sync_awake']:.1f}x",
        f"{ratio_awake:.2f}x",
        f"{ROUND_TRIPS_PER_SYNC_AWAKE:g}",
    )
    Console().print(table)
    print(
        f"a sync makes {RPCS_PER_SYNC} engine RPCs and {MESSAGES_PER_SYNC} serial one-way "
        f"messages ({RPCS_PER_SYNC_AWAKE} and {MESSAGES_PER_SYNC_AWAKE} when the engine reports "
        "it is awake): / rpc near the round trips means the messages are the whole cost; "
        f"zmq_rtt: one {ZMQ_RTT_BYTES}-byte message to a child process and back, no asyncio"
    )
    if (warning := machine.warning()) is not None:
        print(warning)


if __name__ == "__main__":
    main()
