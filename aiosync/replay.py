"""A replay buffer that knows which weight version generated each sample.

Async GRPO generates rollouts with the weights live on the engine while the
trainer already optimizes the next version, so a sample is *stale* by
``policy_version - target_weight_version`` optimizer steps when the trainer
uses it. :class:`VersionedReplayBuffer` subscribes to a synchronizer's
weight-version event stream (:mod:`aiosync.events`) to follow both versions,
stamps every sample with the version it was generated under, and never hands
out a sample staler than ``max_staleness``.

A sample whose tokens came from two versions (a request kept in flight across a
refit, ``sync_weights(in_flight="keep")``; see :class:`~aiosync.Generation`'s
``first_version``/``last_version``) is stamped with the oldest of them by
default (``stamp="oldest"``), so its staleness is never understated; with
``stamp="newest"`` it counts from the newest. Either way:

* when a newer version commits (a ``COMMITTED`` event), samples whose staleness
  exceeds ``max_staleness`` are dropped;
* at use (:meth:`~VersionedReplayBuffer.pop_batch`,
  :meth:`~VersionedReplayBuffer.sample`), staleness is measured against the
  policy version of that moment and too-stale samples are dropped, not returned;
* an ``OVERFLOW`` event (the buffer fell behind the stream) re-reads both
  versions from the event and applies the same rule, so missed events never
  let a stale sample through.

Pure asyncio/trio-agnostic (anyio), no torch: samples are opaque objects.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, Literal, Self, TypeVar, get_args

import anyio
import anyio.abc

from .events import EventSubscription, VersionEventKind, WeightVersionEvent
from .synchronizer import WeightSynchronizer

__all__ = ["STAMPS", "ReplaySample", "StalenessStats", "Stamp", "VersionedReplayBuffer"]

T = TypeVar("T")

#: Which of the versions that produced a sample stamps it: ``"oldest"`` (its
#: staleness counts from the oldest weights that computed any of its tokens)
#: or ``"newest"``.
Stamp = Literal["oldest", "newest"]

#: The values of :data:`Stamp`.
STAMPS: tuple[Stamp, ...] = get_args(Stamp)


@dataclass(frozen=True, slots=True)
class ReplaySample(Generic[T]):
    """One sample handed out by the buffer.

    Attributes:
        item: what was added (a rollout, a group of rollouts, ...).
        target_weight_version: the weight version live on the engine when the
            item was generated.
        policy_version: the trainer's version when the item was handed out.
        staleness: ``policy_version - target_weight_version``, in optimizer steps
            (``0 <= staleness <= max_staleness``).
        other_weight_version: when more than one weight version produced the
            item, the one at the other end from ``target_weight_version`` (the
            newest under ``stamp="oldest"``, the oldest under ``"newest"``);
            None when one version did.
    """

    item: T
    target_weight_version: int
    policy_version: int
    staleness: int
    other_weight_version: int | None = None

    @property
    def spans_versions(self) -> bool:
        """True when more than one weight version produced the item."""
        return self.other_weight_version is not None


@dataclass(slots=True)
class StalenessStats:
    """What the buffer did, for logs and the end-of-run histogram.

    Attributes:
        used: ``{staleness: samples handed out with it}``.
        dropped: ``{staleness: samples dropped with it}`` (staleness at the drop).
        evicted_for_capacity: samples dropped because the buffer was full.
        overflows: ``OVERFLOW`` events received (the buffer fell behind the stream).
        missed_events: events lost to those overflows.
        commits: ``COMMITTED`` events seen.
        failures: ``FAILED`` events seen.
        spanning: samples added whose tokens came from more than one weight version.
    """

    used: Counter[int] = field(default_factory=Counter)
    dropped: Counter[int] = field(default_factory=Counter)
    evicted_for_capacity: int = 0
    overflows: int = 0
    missed_events: int = 0
    commits: int = 0
    failures: int = 0
    spanning: int = 0


@dataclass(slots=True)
class _Entry(Generic[T]):
    item: T
    version: int
    other: int | None = None


class VersionedReplayBuffer(Generic[T]):
    """A FIFO of samples stamped with the weight version that generated them.

    Args:
        sync_or_subscription: a :class:`~aiosync.WeightSynchronizer` (the buffer
            subscribes at construction and reads its live versions directly, so
            stamps never lag the stream) or an :class:`~aiosync.EventSubscription`
            (versions come from the events only; starts at the versions current
            when it subscribed).
        max_staleness: the most optimizer steps a sample may lag the policy when
            it is used, ``>= 0``.
        capacity: the most samples held; adding to a full buffer drops the
            oldest (counted in :attr:`stats`). ``None``: unbounded.
        stamp: which of several versions that produced a sample (``versions=``
            of :meth:`add`) stamps it, and so counts for its staleness:
            ``"oldest"`` (the default: staleness is never understated) or
            ``"newest"``.

    Run it while you use it, either ``async with buffer:`` (a background task)
    or ``tg.start_soon(buffer.run)`` in your own task group; it stops when the
    synchronizer shuts down (the stream ends) or when cancelled.

    Raises:
        ValueError: ``max_staleness < 0``, ``capacity < 1``, or ``stamp`` not one
            of :data:`STAMPS`.
        TypeError: the first argument is neither a synchronizer nor a subscription.
    """

    def __init__(
        self,
        sync_or_subscription: WeightSynchronizer | EventSubscription,
        *,
        max_staleness: int,
        capacity: int | None = None,
        stamp: Stamp = "oldest",
    ) -> None:
        if stamp not in STAMPS or not isinstance(stamp, str):
            raise ValueError(f"stamp must be one of {STAMPS}, got {stamp!r}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise TypeError(f"max_staleness must be an int, got {type(max_staleness).__name__}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        if isinstance(sync_or_subscription, WeightSynchronizer):
            self._sync: WeightSynchronizer | None = sync_or_subscription
            self._subscription = sync_or_subscription.subscribe()
        elif isinstance(sync_or_subscription, EventSubscription):
            self._sync = None
            self._subscription = sync_or_subscription
        else:
            raise TypeError(
                "VersionedReplayBuffer needs a WeightSynchronizer or an EventSubscription, "
                f"got {type(sync_or_subscription).__name__}"
            )
        self.max_staleness = max_staleness
        self.capacity = capacity
        #: Which of several producing versions stamps a sample (see :data:`Stamp`).
        self.stamp: Stamp = stamp
        self.stats = StalenessStats()
        self._policy_version = self._subscription.policy_version
        self._weight_version = self._subscription.weight_version
        self._entries: deque[_Entry[T]] = deque()
        self._changed = anyio.Event()
        self._stream_ended = False
        self._task_group: anyio.abc.TaskGroup | None = None

    # -- versions -------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The trainer's latest version as this buffer knows it."""
        if self._sync is not None:
            return max(self._policy_version, self._sync.policy_version)
        return self._policy_version

    @property
    def weight_version(self) -> int:
        """The version live on all engine workers as this buffer knows it."""
        if self._sync is not None:
            return max(self._weight_version, self._sync.weight_version)
        return self._weight_version

    @property
    def stream_ended(self) -> bool:
        """True once the synchronizer shut down (no more version updates)."""
        return self._stream_ended

    def staleness(self, target_weight_version: int) -> int:
        """``policy_version - target_weight_version`` at this moment, in steps."""
        return self.policy_version - target_weight_version

    # -- adding ----------------------------------------------------------------

    def add(
        self,
        item: T,
        *,
        weight_version: int | None = None,
        versions: Iterable[int | None] | None = None,
    ) -> None:
        """Add one sample.

        Args:
            item: the sample.
            weight_version: the version live when ``item`` was generated; by
                default :attr:`weight_version` now. Pass the version you read
                *before* generating when generation overlaps a refit.
            versions: instead of ``weight_version``, the weight versions the
                engine says computed the item's tokens, e.g. each
                :class:`~aiosync.Generation`'s ``first_version`` and
                ``last_version`` (None entries: the engine's initial weights,
                version 0). The item is stamped with the oldest of them, or the
                newest (``stamp``); :attr:`stats` counts it in ``spanning``
                when they differ.

        Raises:
            ValueError: ``weight_version`` (or an entry of ``versions``) is not
                an int >= 0, ``versions`` is empty, or both are given.
        """
        self.extend([item], weight_version=weight_version, versions=versions)

    def extend(
        self,
        items: Iterable[T],
        *,
        weight_version: int | None = None,
        versions: Iterable[int | None] | None = None,
    ) -> None:
        """Add several samples generated under one ``weight_version``, or together
        by ``versions`` (a GRPO group: every rollout's versions; see :meth:`add`)."""
        other: int | None = None
        if versions is not None:
            if weight_version is not None:
                raise ValueError("pass weight_version or versions, not both")
            known = [0 if v is None else v for v in versions]
            if not known:
                raise ValueError("versions must name at least one weight version")
            for v in known:
                _check_version(v)
            oldest, newest = min(known), max(known)
            version, other = (oldest, newest) if self.stamp == "oldest" else (newest, oldest)
            if oldest == newest:
                other = None
        else:
            version = self.weight_version if weight_version is None else weight_version
            _check_version(version)
        # A version live on the engine was a policy version first: a buffer fed
        # only by events may not have read that STALE event yet.
        self._policy_version = max(self._policy_version, version, other or 0)
        for item in items:
            if self.capacity is not None and len(self._entries) >= self.capacity:
                self._entries.popleft()
                self.stats.evicted_for_capacity += 1
            self._entries.append(_Entry(item, version, other))
            if other is not None:
                self.stats.spanning += 1
        self._notify()

    # -- taking ----------------------------------------------------------------

    def __len__(self) -> int:
        """Samples held (some may be too stale to use; they go at the next use)."""
        return len(self._entries)

    def versions(self) -> list[int]:
        """The ``target_weight_version`` of every held sample, oldest first."""
        return [e.version for e in self._entries]

    def pop_batch_nowait(self, n: int) -> list[ReplaySample[T]]:
        """Remove and return the ``n`` oldest usable samples.

        Samples staler than ``max_staleness`` are dropped first.

        Raises:
            ValueError: ``n < 1``.
            anyio.WouldBlock: fewer than ``n`` usable samples are held (none removed).
        """
        self._check_n(n)
        self._drop_stale()
        if len(self._entries) < n:
            raise anyio.WouldBlock
        policy = self.policy_version
        batch = [self._use(self._entries.popleft(), policy) for _ in range(n)]
        self._notify()
        return batch

    def drain(self) -> list[ReplaySample[T]]:
        """Remove and return every usable sample, oldest first (too-stale ones are dropped)."""
        self._drop_stale()
        policy = self.policy_version
        batch = [self._use(e, policy) for e in self._entries]
        self._entries.clear()
        self._notify()
        return batch

    async def pop_batch(self, n: int) -> list[ReplaySample[T]]:
        """Wait until ``n`` usable samples are held, then remove and return the oldest ``n``.

        Wrap it in ``anyio.fail_after`` to bound the wait.

        Raises:
            ValueError: ``n < 1``, or ``n`` exceeds ``capacity`` (it could never be met).
        """
        if self.capacity is not None and n > self.capacity:
            raise ValueError(f"n={n} exceeds the buffer's capacity {self.capacity}")
        while True:
            changed = self._changed
            try:
                return self.pop_batch_nowait(n)
            except anyio.WouldBlock:
                await changed.wait()

    def sample(self, n: int, *, rng: random.Random | None = None) -> list[ReplaySample[T]]:
        """Return ``n`` distinct usable samples chosen at random, without removing them.

        Samples staler than ``max_staleness`` are dropped first.

        Raises:
            ValueError: ``n < 1`` or fewer than ``n`` usable samples are held.
        """
        self._check_n(n)
        self._drop_stale()
        if len(self._entries) < n:
            raise ValueError(f"asked for {n} samples, {len(self._entries)} usable")
        policy = self.policy_version
        chosen = (rng or random).sample(range(len(self._entries)), n)
        return [self._use(self._entries[i], policy) for i in chosen]

    async def wait_below(self, n: int) -> None:
        """Wait until fewer than ``n`` samples are held (back-pressure for a producer)."""
        while len(self._entries) >= n:
            await self._changed.wait()

    def __iter__(self) -> Iterator[tuple[T, int]]:
        """``(item, target_weight_version)`` of every held sample, oldest first."""
        return ((e.item, e.version) for e in self._entries)

    def histogram(self) -> dict[int, int]:
        """``{staleness: samples used}``, sorted by staleness."""
        return dict(sorted(self.stats.used.items()))

    def format_histogram(self, width: int = 40) -> str:
        """The used-staleness histogram as text bars, with the dropped counts."""
        used = self.histogram()
        total = sum(used.values())
        top = max(used.values(), default=0)
        lines = [f"staleness histogram ({total} samples used, max_staleness={self.max_staleness})"]
        for s, count in used.items():
            bar = "#" * (round(width * count / top) if top else 0)
            lines.append(f"  {s:>3} | {bar} {count}")
        dropped = sum(self.stats.dropped.values())
        lines.append(
            f"  dropped as too stale: {dropped} {dict(sorted(self.stats.dropped.items()))}; "
            f"evicted for capacity: {self.stats.evicted_for_capacity}; "
            f"overflows: {self.stats.overflows}"
        )
        return "\n".join(lines)

    # -- the event task ----------------------------------------------------------

    async def run(self) -> None:
        """Follow the event stream until the synchronizer shuts down or this is cancelled."""
        try:
            async for event in self._subscription:
                self._on_event(event)
        finally:
            self._stream_ended = True
            self._notify()

    def _on_event(self, event: WeightVersionEvent) -> None:
        self._policy_version = max(self._policy_version, event.policy_version)
        self._weight_version = max(self._weight_version, event.weight_version)
        if event.kind is VersionEventKind.STALE:
            self._policy_version = max(self._policy_version, event.version)
        elif event.kind is VersionEventKind.COMMITTED:
            self.stats.commits += 1
            self._weight_version = max(self._weight_version, event.version)
            self._drop_stale()
        elif event.kind is VersionEventKind.FAILED:
            self.stats.failures += 1
        elif event.kind is VersionEventKind.OVERFLOW:
            self.stats.overflows += 1
            self.stats.missed_events += event.missed
            self._drop_stale()
        self._notify()

    async def aclose(self) -> None:
        """Unsubscribe from the stream; held samples stay usable."""
        await self._subscription.aclose()

    async def __aenter__(self) -> Self:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        task_group.start_soon(self.run)
        self._task_group = task_group
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        task_group, self._task_group = self._task_group, None
        assert task_group is not None
        task_group.cancel_scope.cancel()
        try:
            # The body's own exception propagates as is, not wrapped in a group:
            # the task group only ever holds the (cancelled) event task.
            await task_group.__aexit__(None, None, None)
        finally:
            await self.aclose()
        return None

    # -- helpers ---------------------------------------------------------------

    def _drop_stale(self) -> None:
        policy = self.policy_version

        def too_old(e: _Entry[T]) -> bool:
            return policy - e.version > self.max_staleness

        if not any(too_old(e) for e in self._entries):
            return
        kept: deque[_Entry[T]] = deque()
        for e in self._entries:
            if too_old(e):
                self.stats.dropped[policy - e.version] += 1
            else:
                kept.append(e)
        self._entries = kept
        self._notify()

    def _use(self, entry: _Entry[T], policy: int) -> ReplaySample[T]:
        staleness = policy - entry.version
        self.stats.used[staleness] += 1
        return ReplaySample(entry.item, entry.version, policy, staleness, entry.other)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @staticmethod
    def _check_n(n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")


def _check_version(version: object) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight_version must be an int >= 0, got {version!r}")
