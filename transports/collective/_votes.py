"""The trainer ranks' votes of the collective transport: formation over their gloo
group, every sync over the sync store, bounded and independent of a failed rank.

Several trainer ranks agree on every formation and sync with
:meth:`~aiosync.transports._ranks.TrainerRanks.agree` (the outcome encoding IPC
and LoRA use). The formation's exchange runs over the trainer ranks' own gloo
group (:func:`._group.create_sync_group` with ``with_data=False``). A sync's
runs over the ``TCPStore`` of trainer rank 0 (:class:`SyncRounds`), because it
must not depend on a failed rank finishing its part:

* each rank's vote is one store key, written once (``compare_set``) the moment
  the rank fails or finishes, so the others learn of a failure while they still
  sit in a gather of the trainer's own group that the failed rank will never
  join (:class:`SourceReader` lets them stop waiting for it);
* every rank beats a counter in the store (:class:`Heartbeat`); a rank whose beat
  stops for :data:`DEAD_AFTER_S` is voted for, as dead, by whoever notices first,
  and a dead rank is the cause every survivor names;
* a rank that never votes is voted for at the sync's deadline.

See ``docs/reliability.md`` for the fault cells these cover.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.to_thread

from aiosync.errors import RefitMismatchError, TransportError

from .._ranks import TrainerRanks
from .._wire import error_fields
from ._group import SyncGroup

__all__ = [
    "DEAD_AFTER_S",
    "GroupRanks",
    "Heartbeat",
    "PeerFailed",
    "SourceReader",
    "SyncRounds",
    "SyncVotes",
    "agree_formation",
]

#: How often a trainer rank beats its counter in the sync store, seconds.
HEARTBEAT_S = 0.2
#: A rank whose beat has not moved for this long is dead (SIGKILLed, or hung
#: with the interpreter stopped), seconds: far above a beat's period, far below
#: any sync's limit.
DEAD_AFTER_S = 10.0
#: Pause between two looks at the store while a rank waits for the others, seconds.
_POLL_S = 0.05
#: The store key of rank ``r``'s heartbeat counter.
_BEAT_KEY = "aiosync/trainers/beat/{rank}"


class PeerFailed(TransportError):
    """This rank stopped its part because another trainer rank failed (or died): its
    vote is no failure of its own, so the agreement names that rank."""


def _store_gone(exc: BaseException) -> TransportError:
    return TransportError(
        "trainer rank 0: stopped answering during the sync: the sync store it serves "
        f"is gone (its process died?): {type(exc).__name__}"
    )


class Heartbeat:
    """A daemon thread beating this rank's counter in the sync store every
    :data:`HEARTBEAT_S` until :meth:`stop` (the process's liveness, not the sync's:
    a rank busy in its training step still beats).

    Args:
        store: the sync store (rank 0's ``TCPStore``, or a client of it).
        rank: this trainer rank.
    """

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._key = _BEAT_KEY.format(rank=rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"aiosync-heartbeat-{rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store is gone: the votes report it
                return
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        """Stop beating (the thread ends within one period; never waited for)."""
        self._stop.set()


class SyncRounds:
    """One sync's votes among the trainer ranks, over the sync store (blocking calls).

    Args:
        store: the sync store.
        prefix: this sync's key prefix (unique per group session and sync).
        rank, size: this trainer rank and the number of trainer ranks.
        deadline: ``time.monotonic()`` by which every rank must have voted; a
            rank that has not is voted for as late.
    """

    def __init__(self, store: Any, prefix: str, rank: int, size: int, deadline: float) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.size = size
        self.deadline = deadline
        # Per rank: (last beat count seen, monotonic time it was first seen).
        self._beats: dict[int, tuple[int, float]] = {}

    def _key(self, name: str, rank: int) -> str:
        return f"{self.prefix}/{name}/{rank}"

    def _op(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # DistNetworkError, DistStoreError: the server died
            raise _store_gone(exc) from exc

    def _set_once(self, name: str, rank: int, entry: dict[str, Any]) -> dict[str, Any]:
        """Write ``entry`` as ``rank``'s vote unless one is there; returns the vote kept."""
        stored = self._op(self.store.compare_set, self._key(name, rank), "", json.dumps(entry))
        return dict(json.loads(stored))

    def _dead(self, rank: int) -> str | None:
        """Why ``rank`` is dead (its beat stopped for :data:`DEAD_AFTER_S`), or None."""
        beats = int(self._op(self.store.add, _BEAT_KEY.format(rank=rank), 0))
        now = time.monotonic()
        seen = self._beats.get(rank)
        if seen is None or seen[0] != beats:
            self._beats[rank] = (beats, now)
            return None
        if beats and now - seen[1] >= DEAD_AFTER_S:
            return (
                f"stopped answering during the sync: no heartbeat for {DEAD_AFTER_S:g} s "
                "(its process died, or hangs)"
            )
        return None

    def failed_peer(self, name: str) -> int | None:
        """A rank other than this one that voted a failure in round ``name``, or died
        (then voted for, as dead); None when none has."""
        for rank in range(self.size):
            if rank == self.rank:
                continue
            key = self._key(name, rank)
            if self._op(self.store.check, [key]):
                entry = json.loads(self._op(self.store.get, key))
                if entry["vote"] is not None:
                    return rank
            elif (why := self._dead(rank)) is not None:
                self._set_once(name, rank, _dead_entry(why))
                return rank
        return None

    def gather(self, name: str, vote: dict[str, str] | None) -> list[dict[str, str] | None]:
        """Every rank's vote in round ``name``, in rank order (this rank's first written).

        A dead or late rank is voted for by the first rank that notices; when a rank
        is dead, the other ranks' failures are its consequences and count as none.

        Raises:
            TransportError: the store is gone (trainer rank 0 died).
        """
        entries = {self.rank: self._set_once(name, self.rank, {"vote": vote, "dead": False})}
        while len(entries) < self.size:
            for rank in range(self.size):
                if rank in entries:
                    continue
                key = self._key(name, rank)
                if self._op(self.store.check, [key]):
                    entries[rank] = json.loads(self._op(self.store.get, key))
                elif (why := self._dead(rank)) is not None:
                    entries[rank] = self._set_once(name, rank, _dead_entry(why))
                elif time.monotonic() >= self.deadline:
                    entries[rank] = self._set_once(
                        name, rank, _dead_entry("did not reach the vote within the sync's limit")
                    )
            if len(entries) < self.size:
                time.sleep(_POLL_S)
        ordered = [entries[r] for r in range(self.size)]
        if any(e["dead"] for e in ordered):
            return [e["vote"] if e["dead"] else None for e in ordered]
        return [e["vote"] for e in ordered]


def _dead_entry(why: str) -> dict[str, Any]:
    return {"vote": error_fields(TransportError(why)), "dead": True}


class _RoundRanks(TrainerRanks):
    """The trainer ranks as :class:`~aiosync.transports._ranks.TrainerRanks`, gathering
    over one :class:`SyncRounds` round instead of a process group."""

    def __init__(self, rounds: SyncRounds, name: str) -> None:
        super().__init__(None)
        self.rank, self.size = rounds.rank, rounds.size
        self.sharded = self.size > 1
        self.is_driver = self.rank == 0
        self._rounds, self._name = rounds, name

    async def all_gather(self, obj: Any) -> list[Any]:
        return await anyio.to_thread.run_sync(self._rounds.gather, self._name, obj)


class SourceReader:
    """``weights`` read by a daemon thread, so that a rank can stop waiting for a
    gather that a failed rank will never join.

    The thread always iterates ``weights`` to its end (after :meth:`stop` it
    drops what it reads), so that this rank keeps taking part in the gathers a
    failed rank may still drain; if those never complete, only the daemon thread
    waits, and it does not keep the process from exiting. Iterating this object
    yields what ``weights`` yields, at most two tensors ahead, and re-raises its
    error.

    Raises:
        PeerFailed: from ``__next__`` once :meth:`stop` was called.
    """

    def __init__(self, weights: Iterator[Any]) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self._stopped = threading.Event()
        self._reason = ""
        self._thread = threading.Thread(
            target=self._read, args=(weights,), name="aiosync-source-reader", daemon=True
        )
        self._thread.start()

    def _read(self, weights: Iterator[Any]) -> None:
        try:
            for item in weights:
                self._put(("item", item))
        except BaseException as exc:
            self._put(("error", exc))
        else:
            self._put(("end", None))

    def _put(self, entry: tuple[str, Any]) -> None:
        while not self._stopped.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(entry, timeout=_POLL_S)
                return

    def stop(self, reason: str) -> None:
        """Stop handing out tensors: ``__next__`` raises :class:`PeerFailed` (``reason``)."""
        self._reason = reason
        self._stopped.set()

    def __iter__(self) -> SourceReader:
        return self

    def __next__(self) -> Any:
        while True:
            if self._stopped.is_set():
                raise PeerFailed(self._reason)
            try:
                kind, value = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if kind == "item":
                return value
            self._stopped.set()  # nothing more will come
            if kind == "error":
                raise value
            raise StopIteration


def _agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as the agreement's result: voting it again is no new failure."""
    with contextlib.suppress(AttributeError):
        exc.__dict__["_aiosync_agreed"] = True
    return exc


def _as_vote(failure: BaseException | None) -> Exception | None:
    """What a rank votes for ``failure``: none for another rank's failure (a
    :class:`PeerFailed` or an agreed error); a cancellation is voted as an error."""
    if failure is None or isinstance(failure, PeerFailed):
        return None
    if getattr(failure, "_aiosync_agreed", False):
        return None
    if isinstance(failure, Exception):
        return failure
    return TransportError("sync cancelled on a trainer rank")


class SyncVotes:
    """One sync's two trainer votes, in this order on every rank, whatever failed:
    the read of the source (before the workers vote), then the sync's outcome
    (skipped by every rank alike when the read vote failed).

    Args:
        rounds: this sync's :class:`SyncRounds` (None: one rank, nothing is exchanged).
        weights: this sync's ``policy.iter_weights()``; with several ranks it is
            read through a :class:`SourceReader` (:attr:`weights`).
    """

    def __init__(self, rounds: SyncRounds | None, weights: Iterator[Any]) -> None:
        self.rounds = rounds
        self.reader = SourceReader(weights) if rounds is not None else None
        #: What this rank's part iterates.
        self.weights: Iterator[Any] = self.reader if self.reader is not None else weights
        self._read = False
        self._read_error: BaseException | None = None

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """While the block runs (this rank's part), watch the other ranks: once one
        voted a failure or died, the source stops handing out tensors
        (:class:`PeerFailed` in the part), so the part ends without that rank."""
        if self.rounds is None or self.reader is None:
            yield
            return
        rounds, reader = self.rounds, self.reader

        async def watch() -> None:
            with contextlib.suppress(TransportError):  # the store is gone: the vote says so
                while True:
                    peer = await anyio.to_thread.run_sync(rounds.failed_peer, "read")
                    if peer is not None:
                        reader.stop(f"trainer rank {peer} failed")
                        return
                    await anyio.sleep(_POLL_S)

        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                yield
            except BaseException as exc:
                error = exc  # raised as is below, not inside an ExceptionGroup
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error

    async def read(self, failure: BaseException | None) -> None:
        """The read vote. Raises the agreed error (this rank's own, or a failed rank's)."""
        self._read = True
        if self.reader is not None and failure is not None:
            self.reader.stop("this rank failed")
        try:
            await self._agree("read", failure)
        except BaseException as exc:
            self._read_error = exc
            raise

    async def outcome(self, failure: BaseException | None) -> None:
        """The outcome vote (the read vote first if this rank never reached it).

        Raises:
            The agreed error; ``failure`` itself when it is a cancellation.
        """
        if not self._read:
            await self.read(failure)  # raises when any rank failed: the outcome is that
        if self._read_error is not None:
            if failure is not None and not isinstance(failure, Exception):
                raise failure from None
            raise self._read_error
        await self._agree("outcome", failure)

    async def _agree(self, name: str, failure: BaseException | None) -> None:
        """:meth:`TrainerRanks.agree` over round ``name``; a cancelled rank votes an
        error and stays cancelled."""
        ranks = TrainerRanks(None) if self.rounds is None else _RoundRanks(self.rounds, name)
        try:
            # The reader drains the source itself: agree() has nothing to drain.
            await ranks.agree(iter(()), _as_vote(failure))
        except Exception as exc:
            if failure is not None and not isinstance(failure, Exception):
                raise failure from None
            _agreed(exc)
            raise
        if failure is not None and not isinstance(failure, Exception):
            raise failure


async def agree_formation(trainers: SyncGroup, failure: BaseException | None, digest: str) -> None:
    """The trainer ranks' formation vote over their gloo group: the source's outcome,
    then the plan digests.

    Raises:
        The agreed error (:meth:`TrainerRanks.agree`); RefitMismatchError on
        every rank when a rank's bucket plan differs from the source's.
    """
    ranks = GroupRanks(trainers)
    await ranks.agree(iter(()), failure)
    with anyio.CancelScope(shield=True):
        digests = await ranks.all_gather(digest)
    odd = [f"trainer rank {r}" for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise RefitMismatchError(
            f"bucket plan digest differs from trainer rank 0 on {', '.join(odd)}: "
            "the trainer ranks' manifests differ"
        )


class GroupRanks(TrainerRanks):
    """The trainer ranks as :class:`~aiosync.transports._ranks.TrainerRanks`, over the
    collective's control-only gloo group of the trainer ranks."""

    def __init__(self, trainers: SyncGroup) -> None:
        super().__init__(None)
        self.group = trainers
        self.rank, self.size = trainers.rank, trainers.world_size
        self.sharded = self.size > 1
        self.is_driver = self.rank == 0

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-encodable), in rank order; blocks a worker thread."""
        return await anyio.to_thread.run_sync(self.group.all_gather_object, obj)
