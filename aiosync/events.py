"""The weight-version event stream.

Every version that becomes stale, starts moving, lands on all workers or fails
is published as a :class:`WeightVersionEvent`. Async GRPO replay buffers
subscribe to stamp each sample with the weight version it was generated under.

Guarantees (the same precision as anyio's memory object streams):

* Events reach each subscriber in the order they happened.
* Publishing never waits: a slow subscriber never slows or blocks a sync.
* A subscriber that leaves more than ``max_backlog`` events unread is not
  silently dropped from: once it has read what is buffered it receives one
  ``OVERFLOW`` event whose ``missed`` counts the events it lost and whose
  ``policy_version``/``weight_version`` are the versions at that moment; the
  stream then continues with new events.
* A late subscriber reads the versions current when it joined from
  :attr:`EventSubscription.policy_version` / :attr:`EventSubscription.weight_version`.
* Closing the hub (``shutdown()``) ends every subscription: iteration stops
  after the buffered events, and the ``OVERFLOW`` event if one is due, are read.
* Reading is a ``receive()`` of an anyio memory object stream: each read is a
  checkpoint, and a reader cancelled while it waits loses no event (one
  published after the cancellation goes to the next read).
* One event object is shared by every subscriber; it is frozen.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._config import DEFAULT_EVENT_BACKLOG

__all__ = ["EventSubscription", "VersionEventKind", "WeightVersionEvent"]


class VersionEventKind(enum.Enum):
    """What happened to a weight version."""

    STALE = "stale"  #: the trainer advanced ``policy_version`` to ``version``
    SYNC_STARTED = "sync_started"  #: weights of ``version`` started moving
    COMMITTED = "committed"  #: ``version`` is live on all generation workers
    FAILED = "failed"  #: moving ``version`` failed or was cancelled
    OVERFLOW = "overflow"  #: this subscriber missed ``missed`` events
    #: a fleet set ``engine`` aside (``error``: why) while syncing ``version``
    ENGINE_QUARANTINED = "engine_quarantined"
    #: ``engine`` joined its fleet and serves from ``version`` on (its first full sync)
    ENGINE_JOINED = "engine_joined"


@dataclass(frozen=True, slots=True)
class WeightVersionEvent:
    """One event of the weight-version stream.

    Attributes:
        kind: what happened.
        version: the weight version concerned (for ``OVERFLOW``, the policy version).
        timestamp: wall-clock time of the event, seconds since the epoch.
        policy_version: the trainer's latest version when the event was published.
        weight_version: the version live on all workers when the event was published.
        nbytes: bytes moved (``COMMITTED``), else 0.
        duration_s: seconds the sync took (``COMMITTED`` and ``FAILED``), else 0.0.
        error: ``repr`` of the exception (``FAILED``), else ``None``.
        missed: events this subscriber lost (``OVERFLOW``), else 0.
        pause_s: seconds the engine's generation was paused for this sync (from the
            ``pause_generation`` call to the end of ``resume_generation``;
            ``COMMITTED`` and ``FAILED``), 0.0 when it was not paused (an engine
            without ``pause_generation``, or a sync that failed before pausing).
        delta: the sync moved delta patches (``delta=True``: only the elements
            whose bits changed, ``nbytes`` being their encoding) rather than every
            tensor (``COMMITTED``), else False.
        engine: the fleet member concerned (``ENGINE_QUARANTINED``,
            ``ENGINE_JOINED``: ``"engine 1 of 3 (EmbeddedEngine)"``), else None.
        unverified: the checkpoint tensors a ``verify=True`` check of this sync did
            not compare, as ``"name: why"`` in the source's order (``COMMITTED``; the
            HTTP transports: what SGLang's read-back cannot return), else empty.
    """

    kind: VersionEventKind
    version: int
    timestamp: float
    policy_version: int
    weight_version: int
    nbytes: int = 0
    duration_s: float = 0.0
    error: str | None = None
    missed: int = 0
    pause_s: float = 0.0
    delta: bool = False
    engine: str | None = None
    unverified: tuple[str, ...] = ()


class EventSubscription:
    """An async iterator over :class:`WeightVersionEvent`; also an async context manager.

    Created by ``WeightSynchronizer.subscribe()``. Leaving the ``async with`` block
    (or calling :meth:`aclose`) unsubscribes. Each ``__anext__`` is one
    ``receive()`` of an anyio memory object stream (a checkpoint, then the next
    buffered event or a wait for one), so reading costs what reading a bare
    memory object stream costs.
    """

    __slots__ = ("_hub", "_missed", "_receive", "_send", "policy_version", "weight_version")

    def __init__(
        self,
        hub: _EventHub,
        max_backlog: int,
        policy_version: int,
        weight_version: int,
    ) -> None:
        self._hub = hub
        send, receive = anyio.create_memory_object_stream[WeightVersionEvent](max_backlog)
        self._send: MemoryObjectSendStream[WeightVersionEvent] = send
        self._receive: MemoryObjectReceiveStream[WeightVersionEvent] = receive
        # Events lost since the buffer filled up, not yet reported; while it is
        # non-zero the hub counts new events here instead of buffering them, so
        # the subscriber never sees an event after a gap it has not been told about.
        self._missed = 0
        #: ``policy_version`` when this subscription joined.
        self.policy_version = policy_version
        #: ``weight_version`` when this subscription joined.
        self.weight_version = weight_version

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> WeightVersionEvent:
        # ``_missed`` is only set when the buffer was full, so the buffer is
        # looked at (statistics()) only on that rare path: the overflow notice
        # is due once the subscriber has read every buffered event. After a
        # shutdown the notice still comes, before the end of the stream.
        if self._missed and not self._receive.statistics().current_buffer_used:
            return self._hub._overflow_event(self)
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    def receive_nowait(self) -> WeightVersionEvent | None:
        """The next buffered event without waiting; None when none is buffered
        (or the stream ended). An overflow notice comes as in iteration."""
        if self._missed and not self._receive.statistics().current_buffer_used:
            return self._hub._overflow_event(self)
        try:
            return self._receive.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return None

    async def aclose(self) -> None:
        """Unsubscribe; buffered events (and an overflow notice not yet read) are discarded."""
        self._hub._remove(self)
        self._missed = 0
        self._send.close()
        self._receive.close()

    async def __aenter__(self) -> EventSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _EventHub:
    """Fans events out to subscriptions without ever waiting.

    :meth:`publish` runs once per event for every subscriber, on the sync's path,
    so per subscriber in good standing it does one ``send_nowait`` and nothing
    else: it walks the send streams themselves (no call into, or attribute read
    of, the subscription), the event is built once and shared (it is frozen),
    and a subscriber that fell behind is moved aside until it has read its
    overflow notice, so no per-subscriber check is left on the common path.
    """

    def __init__(self, versions: Callable[[], tuple[int, int]]) -> None:
        self._versions = versions
        # Subscriptions in good standing, keyed by their send stream. Dicts, not
        # lists: unsubscribing is O(1) (a thousand subscribers leaving one by
        # one would be quadratic), and they iterate in join order.
        self._live: dict[MemoryObjectSendStream[WeightVersionEvent], EventSubscription] = {}
        # Subscriptions that missed an event and have not read the notice yet:
        # they count events instead of receiving them.
        self._behind: dict[EventSubscription, None] = {}
        self._closed = False

    @property
    def _subscriptions(self) -> list[EventSubscription]:
        """Every subscription receiving or counting events."""
        return [*self._live.values(), *self._behind]

    def subscribe(self, max_backlog: int = DEFAULT_EVENT_BACKLOG) -> EventSubscription:
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {max_backlog}")
        policy, weight = self._versions()
        sub = EventSubscription(self, max_backlog, policy, weight)
        if self._closed:
            sub._send.close()
        else:
            self._live[sub._send] = sub
        return sub

    def publish(
        self,
        kind: VersionEventKind,
        version: int,
        *,
        nbytes: int = 0,
        duration_s: float = 0.0,
        error: str | None = None,
        pause_s: float = 0.0,
        delta: bool = False,
        engine: str | None = None,
        unverified: tuple[str, ...] = (),
    ) -> WeightVersionEvent:
        policy, weight = self._versions()
        event = WeightVersionEvent(
            kind,
            version,
            time.time(),
            policy,
            weight,
            nbytes,
            duration_s,
            error,
            0,
            pause_s,
            delta,
            engine,
            unverified,
        )
        for sub in self._behind:
            sub._missed += 1
        full: list[MemoryObjectSendStream[WeightVersionEvent]] | None = None
        closed: list[MemoryObjectSendStream[WeightVersionEvent]] | None = None
        for send in self._live:
            # try costs nothing when nothing is raised (Python >= 3.11).
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                if full is None:
                    full = []
                full.append(send)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # An end of this stream was closed other than by aclose():
                # nobody can read it any more, so stop offering to it.
                if closed is None:
                    closed = []
                closed.append(send)
        # The dict is not changed while it is walked; moves happen after.
        if full is not None:
            for send in full:
                sub = self._live.pop(send)
                sub._missed = 1
                self._behind[sub] = None
        if closed is not None:
            for send in closed:
                del self._live[send]
        return event

    def _overflow_event(self, sub: EventSubscription) -> WeightVersionEvent:
        """The notice ``sub`` reads once its buffer is empty; ``sub`` is back in good standing."""
        missed, sub._missed = sub._missed, 0
        if sub in self._behind:  # not when the hub was closed meanwhile
            del self._behind[sub]
            self._live[sub._send] = sub
        policy, weight = self._versions()
        return WeightVersionEvent(
            VersionEventKind.OVERFLOW, policy, time.time(), policy, weight, missed=missed
        )

    def _remove(self, sub: EventSubscription) -> None:
        self._live.pop(sub._send, None)
        self._behind.pop(sub, None)

    def close(self) -> None:
        self._closed = True
        for send in self._live:
            send.close()
        for sub in self._behind:
            sub._send.close()
        self._live.clear()
        # Subscriptions behind keep their count: each reads its notice before the end.
        self._behind.clear()
