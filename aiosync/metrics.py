"""Prometheus metrics, and an OpenTelemetry span per sync, fed by the weight-version event stream.

Named and labelled as vLLM's weight-update metrics
(``vllm:rl_weight_update_operation_duration_seconds{operation}``,
``vllm:rl_weight_update_operations_in_flight{operation}``,
``vllm:rl_weight_update_operations_total{operation,status}``) with an ``aiosync_``
prefix, so one dashboard reads both sides of a refit. Needs the ``metrics`` extra
(``prometheus-client``); ``import aiosync`` does not load it. The spans need
``opentelemetry-api`` and are skipped without it. See ``docs/metrics.md``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from threading import Thread
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import anyio
from anyio.abc import TaskStatus
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import start_http_server as _start_http_server

from .events import VersionEventKind, WeightVersionEvent

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from .replay import StalenessStats
    from .synchronizer import WeightSynchronizer

__all__ = [
    "DURATION_BUCKETS_S",
    "STALENESS_BUCKETS",
    "MetricsServer",
    "WeightSyncMetrics",
]

#: Buckets of the duration histogram, in seconds: vLLM's (0.01 ... 600 s) and, below
#: them, the milliseconds a colocated refit or a pause window of a small model takes.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.5,
    1.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

#: Buckets of the sample-staleness histogram, in optimizer steps.
STALENESS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 16, 32)

#: The ``operation`` label: a whole ``sync_weights`` call, and the engine's pause
#: window inside it (``WeightVersionEvent.pause_s``).
OPERATIONS = ("sync", "pause")
#: The ``status`` label, vLLM's words: ``COMMITTED`` is a success, ``FAILED`` (a
#: cancellation included) an error.
STATUSES = ("success", "error")
#: The ``encoding`` label of the bytes counter: every tensor, or delta patches.
ENCODINGS = ("full", "delta")
#: The OpenTelemetry span's name (one per sync) and the tracer's instrumentation name.
SPAN_NAME = "sync_weights"
TRACER_NAME = "aiosync"


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """The HTTP endpoint :meth:`WeightSyncMetrics.serve` started (prometheus-client's
    WSGI server on a daemon thread). Closing it (or leaving its ``with`` block)
    stops serving; otherwise it serves until the process exits."""

    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen when 0 was asked for)."""
        return int(self.server.server_port)

    @property
    def url(self) -> str:
        """Where to scrape: ``http://ADDR:PORT/metrics``."""
        return f"http://{self.server.server_name}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port; waits for the server's thread."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class WeightSyncMetrics:
    """The weight-sync metrics of one synchronizer, on a Prometheus registry.

    Fed by the event stream: ``await task_group.start(metrics.watch, sync)``
    subscribes (before ``start`` returns, so no event is missed) and records every
    event until the synchronizer shuts down; or call :meth:`record` with events
    read elsewhere. The replay buffer's staleness comes from
    :meth:`observe_staleness`. :meth:`serve` exposes the registry over HTTP.

    Metrics (``operation``: ``sync`` | ``pause``; ``status``: ``success`` | ``error``):

    * ``aiosync_weight_update_operation_duration_seconds{operation,status}``
      (histogram, seconds): a sync from ``SYNC_STARTED`` to its end
      (``duration_s``), and the engine's pause window in it (``pause_s``; only a
      sync that paused the engine).
    * ``aiosync_weight_update_operations_total{operation,status}`` (counter): the
      same operations, counted.
    * ``aiosync_weight_update_operations_in_flight{operation="sync"}`` (gauge):
      syncs started and not yet ended.
    * ``aiosync_weight_update_bytes_total{encoding}`` (counter, bytes): moved by
      committed syncs (``nbytes``), ``full`` tensors or ``delta`` patches.
    * ``aiosync_weight_version`` / ``aiosync_policy_version`` (gauges): the
      version live on every engine; the trainer's latest.
    * ``aiosync_engines_quarantined_total`` / ``aiosync_engines_joined_total``
      (counters): fleet members set aside / taken in.
    * ``aiosync_events_missed_total`` (counter): events lost to an ``OVERFLOW``
      (the in-flight gauge then forgets the syncs it saw start).
    * ``aiosync_sample_staleness_steps`` (histogram, optimizer steps): samples
      handed out for training; ``aiosync_samples_dropped_stale_total``,
      ``aiosync_samples_evicted_total`` (counters): samples dropped as too stale,
      evicted for capacity.

    One instance per synchronizer and registry: a second on the same registry
    raises ``ValueError`` (prometheus-client's duplicate-name check).

    With ``opentelemetry-api`` installed, each sync is also a span
    (``sync_weights``, from the ``aiosync`` tracer) from its ``SYNC_STARTED`` to its ``COMMITTED``
    (status OK) or ``FAILED`` (status ERROR, the error as its description), timed
    by the events' timestamps, with the attributes ``aiosync.version``,
    ``aiosync.bytes``, ``aiosync.pause_seconds``, ``aiosync.delta``. Without it,
    no span and no cost.

    Args:
        registry: where the metrics are registered; default prometheus-client's
            process-wide ``REGISTRY``.
        tracer: the OpenTelemetry tracer for the spans; default the global
            provider's ``aiosync`` tracer when ``opentelemetry-api`` is importable
            (a no-op until an SDK is configured), else none.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, tracer: Tracer | None = None
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.tracer = _default_tracer() if tracer is None else tracer
        r = self.registry
        self.duration = Histogram(
            "aiosync_weight_update_operation_duration_seconds",
            "Duration of one weight-update operation (a sync; the engine's pause in it), s.",
            ["operation", "status"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.operations = Counter(
            "aiosync_weight_update_operations",
            "Weight-update operations by outcome (success: committed; error: failed).",
            ["operation", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "aiosync_weight_update_operations_in_flight",
            "Weight-update operations started and not yet ended.",
            ["operation"],
            registry=r,
        )
        self.bytes = Counter(
            "aiosync_weight_update_bytes",
            "Bytes moved by committed syncs (full tensors or delta patches).",
            ["encoding"],
            registry=r,
        )
        self.weight_version = Gauge(
            "aiosync_weight_version", "Weight version live on every engine.", registry=r
        )
        self.policy_version = Gauge(
            "aiosync_policy_version", "The trainer's latest policy version.", registry=r
        )
        self.engines_quarantined = Counter(
            "aiosync_engines_quarantined", "Engines a fleet set aside.", registry=r
        )
        self.engines_joined = Counter(
            "aiosync_engines_joined", "Engines a fleet took in (first full sync).", registry=r
        )
        self.events_missed = Counter(
            "aiosync_events_missed", "Events the metrics' subscription lost.", registry=r
        )
        self.sample_staleness = Histogram(
            "aiosync_sample_staleness_steps",
            "Staleness of the samples handed out for training, optimizer steps.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.samples_dropped_stale = Counter(
            "aiosync_samples_dropped_stale", "Samples dropped as too stale.", registry=r
        )
        self.samples_evicted = Counter(
            "aiosync_samples_evicted", "Samples evicted for the buffer's capacity.", registry=r
        )
        # Every labelled series exists from the first scrape, at zero.
        for operation in OPERATIONS:
            for status in STATUSES:
                self.duration.labels(operation, status)
                self.operations.labels(operation, status)
        self.in_flight.labels("sync")
        for encoding in ENCODINGS:
            self.bytes.labels(encoding)
        # Syncs whose SYNC_STARTED was read and their end not yet: version -> span.
        self._open: dict[int, Span | None] = {}
        self._policy = 0
        self._weight = 0
        self._used_seen: collections.Counter[int] = collections.Counter()
        self._dropped_seen = 0
        self._evicted_seen = 0

    # -- the event stream --------------------------------------------------------

    async def watch(
        self,
        sync: WeightSynchronizer,
        *,
        max_backlog: int | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Record ``sync``'s events until it shuts down (or this is cancelled).

        ``await task_group.start(metrics.watch, sync)`` returns once subscribed:
        every event after that is recorded. The version gauges start at the
        versions current when it subscribed.

        Args:
            sync: the synchronizer whose stream to follow.
            max_backlog: unread events kept before an ``OVERFLOW``; default the
                synchronizer's ``event_backlog``.
        """
        async with sync.subscribe(max_backlog) as events:
            self._versions(events.policy_version, events.weight_version)
            task_status.started()
            async for event in events:
                self.record(event)

    def record(self, event: WeightVersionEvent) -> None:
        """Update the metrics (and the sync's span) from one event, in stream order."""
        self._versions(event.policy_version, event.weight_version)
        kind = event.kind
        if kind is VersionEventKind.SYNC_STARTED:
            self._started(event)
        elif kind is VersionEventKind.COMMITTED or kind is VersionEventKind.FAILED:
            self._ended(event, "success" if kind is VersionEventKind.COMMITTED else "error")
        elif kind is VersionEventKind.STALE:
            self._versions(event.version, 0)
        elif kind is VersionEventKind.ENGINE_QUARANTINED:
            self.engines_quarantined.inc()
        elif kind is VersionEventKind.ENGINE_JOINED:
            self.engines_joined.inc()
        elif kind is VersionEventKind.OVERFLOW:
            self.events_missed.inc(event.missed)
            # The end of a sync seen starting may be among the lost events.
            for version in list(self._open):
                self._close(version, event, None)

    def _versions(self, policy: int, weight: int) -> None:
        if policy > self._policy:
            self._policy = policy
            self.policy_version.set(policy)
        if weight > self._weight:
            self._weight = weight
            self.weight_version.set(weight)

    def _started(self, event: WeightVersionEvent) -> None:
        if event.version in self._open:  # cannot happen: a synchronizer's syncs take turns
            self._close(event.version, event, None)
        self.in_flight.labels("sync").inc()
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span(
                SPAN_NAME,
                start_time=_ns(event.timestamp),
                attributes={"aiosync.version": event.version},
            )
        self._open[event.version] = span

    def _ended(self, event: WeightVersionEvent, status: str) -> None:
        self.duration.labels("sync", status).observe(event.duration_s)
        self.operations.labels("sync", status).inc()
        if event.pause_s > 0:
            self.duration.labels("pause", status).observe(event.pause_s)
            self.operations.labels("pause", status).inc()
        if status == "success":
            self.bytes.labels("delta" if event.delta else "full").inc(event.nbytes)
            self._versions(0, event.version)
        if event.version in self._open:  # not a sync that started before watching
            self._close(event.version, event, status)

    def _close(self, version: int, event: WeightVersionEvent, status: str | None) -> None:
        """The sync of ``version`` ended at ``event`` (``status`` None: its end was lost)."""
        span = self._open.pop(version)
        self.in_flight.labels("sync").dec()
        if span is not None:
            _end_span(span, event, status)

    # -- the replay buffer -------------------------------------------------------

    def observe_staleness(self, stats: StalenessStats) -> None:
        """Record what a replay buffer did since the last call.

        Args:
            stats: the buffer's cumulative :class:`~aiosync.StalenessStats`
                (``VersionedReplayBuffer.stats``), the same buffer's every call:
                the samples it handed out since the last call are observed in
                ``aiosync_sample_staleness_steps`` (optimizer steps), those it
                dropped or evicted are counted.
        """
        for steps, used in list(stats.used.items()):
            for _ in range(used - self._used_seen[steps]):
                self.sample_staleness.observe(steps)
            self._used_seen[steps] = used
        dropped = sum(stats.dropped.values())
        self.samples_dropped_stale.inc(max(0, dropped - self._dropped_seen))
        self._dropped_seen = max(self._dropped_seen, dropped)
        evicted = stats.evicted_for_capacity
        self.samples_evicted.inc(max(0, evicted - self._evicted_seen))
        self._evicted_seen = max(self._evicted_seen, evicted)

    # -- serving -----------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve the registry for Prometheus at ``http://addr:port/metrics``.

        Args:
            port: TCP port; 0 picks a free one (:attr:`MetricsServer.port`).
            addr: the address to bind; the loopback by default (expose it
                deliberately: the endpoint has no authentication).

        Raises:
            OSError: the port is taken.
        """
        server, thread = _start_http_server(port, addr=addr, registry=self.registry)
        return MetricsServer(server, thread)


def _default_tracer() -> Tracer | None:
    """The global provider's ``aiosync`` tracer, or None without ``opentelemetry-api``."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer(TRACER_NAME)


def _ns(timestamp_s: float) -> int:
    """Seconds since the epoch as OpenTelemetry's nanoseconds."""
    return int(timestamp_s * 1e9)


def _end_span(span: Span, event: WeightVersionEvent, status: str | None) -> None:
    """End a sync's span at ``event`` (its ``COMMITTED``/``FAILED``, or the
    ``OVERFLOW`` that lost it: status unset)."""
    from opentelemetry.trace import Status, StatusCode

    attributes: dict[str, Any] = {}
    if status is not None:
        attributes = {
            "aiosync.bytes": event.nbytes,
            "aiosync.pause_seconds": event.pause_s,
            "aiosync.delta": event.delta,
        }
    span.set_attributes(attributes)
    if status == "success":
        span.set_status(Status(StatusCode.OK))
    elif status == "error":
        span.set_status(Status(StatusCode.ERROR, event.error))
    span.end(end_time=_ns(event.timestamp))
