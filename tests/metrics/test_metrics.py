"""aiosync.metrics: the registry holds what the event stream said, and the example serves it.

The synchronizer is the base class's test transport (a real, in-process
``WeightSynchronizer`` that copies arrays: tests/core/core_harness.py) into an
engine that pauses; the scrape is of the async GRPO example, run with
``--metrics-port``, over HTTP.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from aiosync import InFlightPolicy, StalenessStats, VersionEventKind, WeightVersionEvent
from aiosync.metrics import MetricsServer, WeightSyncMetrics
from tests._support.modules import load_module
from tests._support.net import free_port
from tests.core.core_harness import ArraySource, CopySynchronizer, RecordingEngine

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "async_grpo.py"

DURATION = "aiosync_weight_update_operation_duration_seconds"
OPERATIONS = "aiosync_weight_update_operations_total"
IN_FLIGHT = "aiosync_weight_update_operations_in_flight"
BYTES = "aiosync_weight_update_bytes_total"
STALENESS = "aiosync_sample_staleness_steps"
#: ArraySource's weights: float32 arrays of 4 and 2 x 2 elements.
SOURCE_NBYTES = (4 + 2 * 2) * 4


class PausingEngine(RecordingEngine):
    """The harness's engine, pausable: each sync opens a pause window on it."""

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", None))

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", None))


@dataclass
class Run:
    """What the scenario's synchronizer published, and the in-flight gauge mid-sync."""

    events: list[WeightVersionEvent]
    in_flight_mid_sync: float | None

    def of(self, kind: VersionEventKind) -> list[WeightVersionEvent]:
        return [e for e in self.events if e.kind is kind]


async def two_commits_and_a_failure(metrics: WeightSyncMetrics) -> Run:
    """Versions 1 and 2 commit, version 3 fails after its first tensor; ``metrics``
    watches throughout, until the synchronizer shuts down."""
    source = ArraySource()
    sync = CopySynchronizer(source, PausingEngine())
    await sync.init_communicator()
    mine = sync.subscribe()
    async with anyio.create_task_group() as tg:
        await tg.start(metrics.watch, sync)
        for _ in range(2):
            async with sync.policy_update():
                source.step()
            await sync.sync_weights()
        async with sync.policy_update():
            source.step()
        sync.gate, sync.started = anyio.Event(), anyio.Event()
        sync.fail_after_entries = 1

        async def fails() -> None:
            with pytest.raises(RuntimeError, match="link dropped after 1 entries"):
                await sync.sync_weights()

        async with anyio.create_task_group() as inner:
            inner.start_soon(fails)
            await sync.started.wait()  # held after its first tensor
            await anyio.wait_all_tasks_blocked()  # the watcher read SYNC_STARTED
            in_flight = metrics.registry.get_sample_value(IN_FLIGHT, {"operation": "sync"})
            sync.gate.set()
        await sync.shutdown()  # ends the stream: watch returns
    return Run([e async for e in mine], in_flight)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_two_commits_and_a_failure_are_counted_as_their_events_say() -> None:
    registry = CollectorRegistry()
    run = await two_commits_and_a_failure(WeightSyncMetrics(registry))
    committed = run.of(VersionEventKind.COMMITTED)
    (failed,) = run.of(VersionEventKind.FAILED)
    assert [e.version for e in committed] == [1, 2] and failed.version == 3

    def v(name: str, **labels: str) -> float | None:
        return value(registry, name, **labels)

    for op, seconds in (("sync", "duration_s"), ("pause", "pause_s")):
        assert v(f"{DURATION}_count", operation=op, status="success") == 2
        assert v(f"{DURATION}_sum", operation=op, status="success") == sum(
            getattr(e, seconds) for e in committed
        )
        assert v(f"{DURATION}_count", operation=op, status="error") == 1
        assert v(f"{DURATION}_sum", operation=op, status="error") == getattr(failed, seconds)
        assert v(OPERATIONS, operation=op, status="success") == 2
        assert v(OPERATIONS, operation=op, status="error") == 1
    # Bytes are the committed syncs' (the failed one's copy of one tensor is not counted).
    assert v(BYTES, encoding="full") == sum(e.nbytes for e in committed) == 2 * SOURCE_NBYTES
    assert v(BYTES, encoding="delta") == 0
    # One sync was in flight while held; none is once it failed.
    assert (run.in_flight_mid_sync, v(IN_FLIGHT, operation="sync")) == (1, 0)
    assert (v("aiosync_weight_version"), v("aiosync_policy_version")) == (2, 3)
    assert v("aiosync_engines_quarantined_total") == v("aiosync_engines_joined_total") == 0
    assert v("aiosync_events_missed_total") == 0


def event(kind: VersionEventKind, version: int, **fields: Any) -> WeightVersionEvent:
    return WeightVersionEvent(kind, version, 1.0, version, 0, **fields)


def test_an_end_lost_to_an_overflow_or_a_start_before_watching_leaves_none_in_flight() -> None:
    registry = CollectorRegistry()
    metrics = WeightSyncMetrics(registry, tracer=None)
    # Version 4 started before the metrics watched: its end is counted, in flight untouched.
    metrics.record(event(VersionEventKind.COMMITTED, 4, nbytes=10, duration_s=0.5))
    assert value(registry, IN_FLIGHT, operation="sync") == 0
    metrics.record(event(VersionEventKind.SYNC_STARTED, 5))
    assert value(registry, IN_FLIGHT, operation="sync") == 1
    # The stream lost 3 events, version 5's end perhaps among them.
    metrics.record(event(VersionEventKind.OVERFLOW, 5, missed=3))
    assert value(registry, IN_FLIGHT, operation="sync") == 0
    assert value(registry, "aiosync_events_missed_total") == 3
    metrics.record(event(VersionEventKind.COMMITTED, 5, nbytes=20, duration_s=0.25, delta=True))
    assert value(registry, IN_FLIGHT, operation="sync") == 0
    assert value(registry, OPERATIONS, operation="sync", status="success") == 2
    assert (value(registry, BYTES, encoding="full"), value(registry, BYTES, encoding="delta")) == (
        10,
        20,
    )
    assert value(registry, "aiosync_weight_version") == 5


def test_staleness_observes_what_the_buffer_handed_out_since_the_last_call() -> None:
    registry = CollectorRegistry()
    metrics = WeightSyncMetrics(registry, tracer=None)
    stats = StalenessStats()
    stats.used.update({0: 3, 2: 1})
    metrics.observe_staleness(stats)
    metrics.observe_staleness(stats)  # nothing new
    stats.used.update({2: 1, 5: 2})
    stats.dropped.update({6: 4})
    stats.evicted_for_capacity = 2
    metrics.observe_staleness(stats)
    assert value(registry, f"{STALENESS}_count") == 7
    assert value(registry, f"{STALENESS}_sum") == 2 * 2 + 5 * 2
    assert [
        value(registry, f"{STALENESS}_bucket", le=le) for le in ("0.0", "2.0", "4.0", "6.0")
    ] == [
        3,
        5,
        5,
        7,
    ]
    assert value(registry, "aiosync_samples_dropped_stale_total") == 4
    assert value(registry, "aiosync_samples_evicted_total") == 2


async def test_each_sync_is_one_span_timed_by_its_events() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk not installed")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    provider = sdk.TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = WeightSyncMetrics(CollectorRegistry(), tracer=provider.get_tracer("test"))
    run = await two_commits_and_a_failure(metrics)
    starts = run.of(VersionEventKind.SYNC_STARTED)
    ends = [
        e for e in run.events if e.kind in (VersionEventKind.COMMITTED, VersionEventKind.FAILED)
    ]
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["sync_weights"] * 3
    assert [s.attributes["aiosync.version"] for s in spans] == [1, 2, 3]
    assert [s.status.status_code for s in spans] == [StatusCode.OK] * 2 + [StatusCode.ERROR]
    assert spans[2].status.description == ends[2].error
    assert [s.attributes["aiosync.bytes"] for s in spans] == [e.nbytes for e in ends]
    assert [(s.start_time, s.end_time) for s in spans] == [
        (int(a.timestamp * 1e9), int(b.timestamp * 1e9)) for a, b in zip(starts, ends, strict=True)
    ]


def test_import_aiosync_loads_neither_prometheus_nor_opentelemetry() -> None:
    code = (
        "import sys, aiosync, aiosync.events, aiosync.replay; "
        "print(sorted(m for m in ('prometheus_client', 'opentelemetry') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


@pytest.mark.slow
def test_the_example_serves_its_refits_to_a_prometheus_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Run in this process, so the endpoint is still up when the run has ended and
    # the scrape sees its final values; the server is closed after.
    example = load_module(EXAMPLE, "async_grpo_example")
    servers: list[MetricsServer] = []
    serve = WeightSyncMetrics.serve

    def recording_serve(self: WeightSyncMetrics, port: int, addr: str = "127.0.0.1") -> Any:
        servers.append(serve(self, port, addr))
        return servers[-1]

    monkeypatch.setattr(WeightSyncMetrics, "serve", recording_serve)
    port = free_port()
    threads = torch.get_num_threads()
    try:
        report = example.main(
            [
                "--quick",
                "--quiet",
                "--colocated",
                "--steps",
                "2",
                "--no-verify",
                "--metrics-port",
                str(port),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    (server,) = servers
    try:
        assert server.server.server_address == ("127.0.0.1", port)  # the loopback only
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    finally:
        server.close()
    assert response.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }

    def v(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    refits = report.refits
    assert refits and report.refit_failures == 0
    assert v(OPERATIONS, operation="sync", status="success") == len(refits)
    assert v(OPERATIONS, operation="sync", status="error") == 0
    assert v(f"{DURATION}_count", operation="sync", status="success") == len(refits)
    assert v(f"{DURATION}_sum", operation="sync", status="success") == sum(
        r["seconds"] for r in refits
    )
    # The embedded engine is paused for every refit.
    assert v(f"{DURATION}_count", operation="pause", status="success") == len(refits)
    assert v(BYTES, encoding="full") == sum(r["nbytes"] for r in refits)
    assert v(IN_FLIGHT, operation="sync") == 0
    assert v("aiosync_weight_version") == report.final_weight_version == refits[-1]["version"]
    assert v("aiosync_policy_version") == report.final_policy_version
    assert v(f"{STALENESS}_count") == len(report.samples)
    assert v(f"{STALENESS}_sum") == sum(staleness for _, _, staleness in report.samples)
