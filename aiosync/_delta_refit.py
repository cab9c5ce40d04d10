"""The synchronizer's side of delta refits, for every transport (see ``docs/delta-fp8.md``).

A transport that sends patches holds a baseline (:class:`~aiosync.delta.DeltaBaseline`,
or the shard-aware path's ``ShardBaseline``): the trainer's bits of the last version
committed on every worker. When that baseline advances, when it is dropped, and which
engines may still be patched against it are the same questions on every transport;
:class:`DeltaRefit` answers them once, and the synchronizer calls it at each outcome.
Torch-free: ``import aiosync`` stays light.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from .capabilities import DiscardNotifier

__all__ = ["Baseline", "DeltaRefit"]


class Baseline(Protocol):
    """What :class:`DeltaRefit` needs of a baseline (:class:`~aiosync.delta.DeltaBaseline`)."""

    #: The version the baseline holds; None: none (the next sync is full).
    version: int | None

    def commit(self) -> None:
        """The staged sync committed on every worker: the baseline becomes its version."""

    def invalidate(self) -> None:
        """Forget the baseline: the next sync is a full one."""


B = TypeVar("B", bound=Baseline)


class DeltaRefit(Generic[B]):
    """A transport's delta baseline and which engines still hold it.

    An engine that discarded its weights since the baseline committed (woken from a
    level-2 sleep, a respawned worker) holds something else: it gets every tensor at
    the next sync while the others get patches. Discards are counted per engine
    (``id()``: a fleet's members change), from the engines' own notices
    (:class:`~aiosync.capabilities.DiscardNotifier`); an engine that gives none is
    asked by the transport (the workers' held version).

    The synchronizer calls :meth:`begin` as a sync starts, :meth:`settle` with its
    outcome (commit on every worker, or a failure, cancellation or quarantine round),
    and :meth:`invalidate` when :meth:`~aiosync.WeightSynchronizer.verify_engine` found
    live weights that are not the baseline's.
    """

    def __init__(self, baseline: B) -> None:
        #: The trainer's bits of the last version committed on every worker.
        self.baseline = baseline
        self._discards: dict[int, int] = {}
        # Each engine's discards as of the sync that committed the baseline, and as of
        # the sync in flight.
        self._at_baseline: dict[int, int] = {}
        self._at_sync: dict[int, int] = {}
        self._hooks: list[tuple[DiscardNotifier, Callable[[], None]]] = []

    def watch(self, engines: Iterable[Any]) -> None:
        """Count the discards of each engine not watched yet (at construction, and when
        a fleet's membership changed: a new member gets every tensor until a commit)."""
        for engine in engines:
            key = id(engine)
            if key in self._discards:
                continue
            self._discards[key] = 0
            if isinstance(engine, DiscardNotifier):
                hook = functools.partial(self._discarded, key)
                engine.add_weights_discarded_listener(hook)
                self._hooks.append((engine, hook))

    def _discarded(self, key: int) -> None:
        self._discards[key] = self._discards.get(key, 0) + 1

    def begin(self) -> None:
        """A sync starts: what it commits is measured from the discards seen now."""
        self._at_sync = dict(self._discards)

    def holds(self, engine: object, version: int) -> bool:
        """Whether ``engine`` may hold the baseline whole and the baseline is ``version``
        (the synchronizer's ``weight_version``): no discard since the baseline
        committed, as of this sync's :meth:`begin`. The workers still confirm it."""
        key = id(engine)
        return (
            self.baseline.version is not None
            and self.baseline.version == version
            and key in self._at_baseline
            and self._at_sync.get(key) == self._at_baseline[key]
        )

    def settle(self, *, committed: bool) -> None:
        """The sync that staged the baseline committed on every worker (it advances), or
        failed after its transfer started (what it wrote is no base: dropped)."""
        if committed:
            self.baseline.commit()
            self._at_baseline = self._at_sync
        else:
            self.baseline.invalidate()

    def invalidate(self) -> None:
        """The workers' live weights are not the baseline's: the next sync is full."""
        self.baseline.invalidate()

    def close(self) -> None:
        """Stop listening to the engines (the synchronizer's shutdown)."""
        for engine, hook in self._hooks:
            engine.remove_weights_discarded_listener(hook)
        self._hooks = []
