"""The formed sync group of one session: its collectives, its votes, its teardown.

:class:`SyncGroup` holds a session's store and its two process groups (``ctrl``:
gloo, every rank, the votes; ``data``: the bucket broadcasts), as
:func:`~aiosync.transports.collective._group.create_sync_group` forms them (the
design: :mod:`aiosync.transports.collective._group`).

Every blocking call here has the group's timeout (seconds). Failures surface as
:class:`~aiosync.errors.TransportError` (a peer died, the connection closed) or
:class:`~aiosync.errors.SyncTimeoutError` and mark the group :attr:`SyncGroup.broken`.

A group can be aborted (:meth:`SyncGroup.abort`): the reason goes under the
session's ``aborted`` key, and every rank waiting in a gloo collective of it
looks for that key (and whether trainer rank 0, which serves the store, still
answers) every 0.1 s, so it gives up at once with a
:class:`~aiosync.errors.TransportError` quoting the reason (a dead engine worker,
named) or saying that trainer rank 0 is gone, instead of sitting out the
group's timeout: gloo itself notices neither.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, BroadcastOptions

from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError

__all__ = [
    "STATUS_ERROR",
    "STATUS_MISMATCH",
    "STATUS_OK",
    "STATUS_TIMEOUT",
    "SyncGroup",
    "describe_rank",
    "first_line",
    "teardown",
    "translate_error",
]

#: Vote codes (one per rank) exchanged after each sync and at formation.
STATUS_OK = 0
STATUS_MISMATCH = 1
STATUS_ERROR = 2
STATUS_TIMEOUT = 3

_DIGEST_BYTES = 32  # SHA-256 of the bucket plan

#: The session's key whose presence aborts its groups (:meth:`SyncGroup.abort`).
_ABORT_KEY = "aborted"
#: How long a rank waits on a gloo collective before it looks again whether the group
#: was aborted or trainer rank 0 (its store) is gone, seconds.
_WATCH_S = 0.1


def describe_rank(rank: int, train_world_size: int) -> str:
    """Session ``rank`` in words: ``"trainer rank 0"``, ``"inference rank 2"``."""
    if rank < train_world_size:
        return f"trainer rank {rank}"
    return f"inference rank {rank - train_world_size}"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, else its type's name."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def translate_error(
    exc: BaseException,
    what: str,
    *,
    timed_out: type[SyncError] = SyncTimeoutError,
    failed: type[SyncError] = TransportError,
) -> SyncError:
    """A torch / gloo / NCCL error as aiosync's, ``what`` (the operation) leading its
    message: ``timed_out`` when its first line speaks of a timeout, else ``failed``."""
    text = first_line(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return timed_out(f"{what}: {text}")
    return failed(f"{what}: {text}")


class _NothingSent:
    """The work handle of a broadcast that moved nothing (an empty tensor)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_NOTHING_SENT = _NothingSent()


@dataclass(eq=False)
class SyncGroup:
    """One session's store and process groups (see the module docstring).

    Attributes:
        rank: this process's rank in the session (trainer ``0..T-1``, inference ``T..``).
        world_size: ``T + W`` ranks.
        train_world_size: ``T``, the trainer ranks.
        backend: ``"nccl"`` or ``"gloo"``, the data group's backend.
        device: where bucket buffers live (``cuda:N`` for nccl, ``cpu`` for gloo).
        timeout_s: limit of every collective and store wait, seconds.
        broken: a collective failed; the group must be destroyed and formed again.
        collective_failed: a collective of this rank failed, or gave up because the
            group was aborted or trainer rank 0 is gone (not: a vote that agreed on
            a failure).
    """

    rank: int
    world_size: int
    train_world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    store: dist.Store | None
    ctrl: Any
    data: Any | None
    session: str
    broken: bool = False
    collective_failed: bool = False
    #: The store the gloo groups met over; held because the groups hold its
    #: C++ half, whose Python methods vanish with the Python object.
    rendezvous: Any = None
    _votes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_source(self) -> bool:
        """True on trainer rank 0, the only rank that sends."""
        return self.rank == 0

    def describe_rank(self, rank: int) -> str:
        """``"trainer rank 0"`` / ``"inference rank 2"`` for error messages."""
        return describe_rank(rank, self.train_world_size)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        if self.broken:
            raise TransportError(f"{what}: the sync group is broken; form it again")
        try:
            yield
        except SyncError:
            self.broken = self.collective_failed = True
            raise
        except Exception as exc:
            self.broken = self.collective_failed = True
            raise translate_error(exc, what) from exc

    # -- data group ------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, *, what: str) -> Any:
        """Start broadcasting contiguous ``tensor`` from the source; returns the work handle.

        Call :meth:`wait` on the handle before reading (receiver) or reusing
        (source) ``tensor``. An empty ``tensor`` (a bucket of zero-size
        tensors) is not sent: every rank derives the same sizes from the plan,
        so all of them skip it. Raises :class:`TransportError` on a non-data rank.
        """
        if self.data is None:
            raise TransportError(f"{self.describe_rank(self.rank)} has no data group")
        if tensor.numel() == 0:
            # A zero-count NCCL collective may be handed a null data pointer.
            return _NOTHING_SENT
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        with self._guard(what):
            return self.data.broadcast([tensor], opts)

    def wait(self, work: Any, *, what: str) -> None:
        """Wait for a handle from :meth:`broadcast` (on CUDA: the current stream waits).

        Raises:
            TransportError: the collective failed, the group was aborted (the
                reason quoted: a dead engine worker, a failed rank) or trainer
                rank 0 is gone (see :meth:`_finish`).
            SyncTimeoutError: the collective ran past the group's timeout.
        """
        with self._guard(what):
            self._finish(work, what, sliced=self.backend == "gloo")

    def _finish(self, work: Any, what: str, *, sliced: bool) -> None:
        """Wait for ``work``; on gloo (``sliced``) in slices of :data:`_WATCH_S`, between
        which this rank looks whether the group was aborted and whether trainer rank 0,
        which serves the session's store, still answers.

        gloo notices neither a peer that died (a receiver waits for bytes a starved
        or dead rank never sends; the source for a receive a dead rank never posts)
        nor a group torn down elsewhere: its ``abort()`` closes no connection. Without
        the look every rank would sit out the whole timeout. An NCCL wait only makes
        the current stream wait (it does not block).

        Raises:
            TransportError: the group was aborted (its reason quoted), or the store
                stopped answering (trainer rank 0 died).
        """
        if not sliced:
            work.wait()
            return
        pause = datetime.timedelta(seconds=_WATCH_S)
        while True:
            try:
                work.wait(pause)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # done meanwhile, or failed: its own outcome
                    return
            self._watch(what)

    def _watch(self, what: str) -> None:
        """Raise if this group was aborted or its store (trainer rank 0) is gone."""
        store = self.store
        if store is None:
            raise TransportError(f"{what}: the sync group was destroyed")
        try:
            aborted = store.check([_ABORT_KEY])
            reason = store.get(_ABORT_KEY).decode(errors="replace") if aborted else ""
        except Exception as exc:  # DistNetworkError, DistStoreError: the server is gone
            raise TransportError(
                f"{what}: trainer rank 0 is gone: the sync group's store it serves "
                f"stopped answering ({first_line(exc)})"
            ) from exc
        if aborted:
            raise TransportError(f"{what}: the sync group was aborted: {reason}")

    # -- control group ---------------------------------------------------------

    def exchange(
        self, status: int, message: str = "", digest: str = ""
    ) -> list[tuple[int, str, str]]:
        """All ranks publish a status code, a message and a plan digest; all get all.

        A rank with a non-OK status writes its message to the store before the
        all-gather, so every other rank can read it right after, without waiting.

        Returns:
            ``[(status, digest_hex, message)]`` indexed by session rank.
        """
        with self._lock:
            self._votes += 1
            key = f"vote/{self._votes}/"
        payload = torch.zeros(1 + _DIGEST_BYTES, dtype=torch.uint8)
        payload[0] = status
        if digest:
            payload[1:] = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
        outs = [torch.empty_like(payload) for _ in range(self.world_size)]
        with self._guard("control all-gather"):
            if self.store is None or self.ctrl is None:
                raise TransportError("the sync group was destroyed")
            if status != STATUS_OK:
                self.store.set(key + str(self.rank), message)
            opts = AllgatherOptions()
            opts.timeout = datetime.timedelta(seconds=self.timeout_s)
            work = self.ctrl.allgather([outs], [payload], opts)
            self._finish(work, "control all-gather", sliced=True)
            result = []
            for rank, out in enumerate(outs):
                code = int(out[0])
                text = ""
                if code != STATUS_OK:
                    text = (
                        message if rank == self.rank else self.store.get(key + str(rank)).decode()
                    )
                result.append((code, bytes(out[1:].tolist()).hex(), text))
        return result

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-encodable), in session-rank order (blocking).

        Each rank writes its ``obj`` to the store, the control all-gather is the
        barrier, then each reads the others': the trainer ranks' agreement
        (:class:`~aiosync.transports._ranks.TrainerRanks`) runs over it.

        Raises:
            TransportError, SyncTimeoutError: a rank died or timed out (group broken).
        """
        with self._lock:
            self._votes += 1
            key = f"objects/{self._votes}/"
        token = torch.zeros(1, dtype=torch.uint8)
        outs = [torch.empty_like(token) for _ in range(self.world_size)]
        with self._guard("control all-gather"):
            if self.store is None or self.ctrl is None:
                raise TransportError("the sync group was destroyed")
            self.store.set(key + str(self.rank), json.dumps(obj))
            opts = AllgatherOptions()
            opts.timeout = datetime.timedelta(seconds=self.timeout_s)
            work = self.ctrl.allgather([outs], [token], opts)
            self._finish(work, "control all-gather", sliced=True)
            return [
                obj if rank == self.rank else json.loads(self.store.get(key + str(rank)))
                for rank in range(self.world_size)
            ]

    def agree(self, status: int, message: str = "", digest: str = "") -> None:
        """:meth:`exchange`, then raise the same error on every rank if anyone failed.

        Raises:
            RefitMismatchError: a rank reported a manifest mismatch, or digests differ.
            SyncTimeoutError: every failing rank reported a timeout.
            TransportError: a rank reported another failure.
        """
        votes = self.exchange(status, message, digest)
        problems = [
            f"{self.describe_rank(r)}: {text}"
            for r, (code, _, text) in enumerate(votes)
            if code != STATUS_OK
        ]
        if digest:
            digests = {d for _, d, _ in votes}
            if len(digests) > 1:
                odd = [
                    self.describe_rank(r) for r, (_, d, _) in enumerate(votes) if d != votes[0][1]
                ]
                problems.append(
                    f"bucket plan digest differs from {self.describe_rank(0)} on {', '.join(odd)}"
                )
        if not problems:
            return
        text = "; ".join(problems)
        codes = {code for code, _, _ in votes}
        if (digest and len({d for _, d, _ in votes}) > 1) or STATUS_MISMATCH in codes:
            raise RefitMismatchError(text)
        if codes - {STATUS_OK} == {STATUS_TIMEOUT}:
            raise SyncTimeoutError(text)
        raise TransportError(text)

    # -- teardown --------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Make every rank waiting in a collective of this session give up: each raises
        :class:`~aiosync.errors.TransportError` quoting ``reason`` within
        :data:`_WATCH_S` (gloo; see :meth:`_finish`). The first reason written is kept
        (it names the cause; later ones are its echoes). Marks the group broken.
        Never raises: a store that is gone has no one waiting on it."""
        self.broken = True
        store = self.store
        if store is not None:
            with contextlib.suppress(Exception):
                store.compare_set(_ABORT_KEY, "", reason)

    def destroy(self) -> None:
        """Tear down both groups and drop the store. Idempotent; never raises; never
        blocks on a peer.

        A healthy group is shut down gracefully. A broken one is aborted
        (:meth:`abort`: the peers still waiting in it give up at once) and its
        backends are released in a thread of their own: a gloo group whose collective
        is still pending blocks its destructor until that collective times out.
        """
        if self.broken and self.store is not None:
            self.abort(f"{self.describe_rank(self.rank)} left the broken sync group")
        backends = [self.data, self.ctrl]
        self.data = None
        self.ctrl = None
        self.store = None
        self.rendezvous = None
        _release(backends, broken=self.broken)
        self.broken = True


def teardown(pg: Any, *, broken: bool) -> None:
    """Tear down backend ``pg`` (None: nothing): aborted when ``broken``, else shut
    down gracefully. Never raises.

    NCCL's abort fails the pending collectives on the peers; gloo's (torch 2.13)
    closes no connection, so its peers learn of it from :meth:`SyncGroup.abort`'s
    key instead. Release broken groups with :func:`_release`: dropping a gloo
    backend blocks until its pending collectives time out."""
    if pg is None:
        return
    try:
        if broken and hasattr(pg, "abort"):
            pg.abort()
        else:
            pg.shutdown()
    except Exception:  # teardown of a group whose peers are gone
        pass


def _release(backends: list[Any], *, broken: bool) -> None:
    """Tear down ``backends`` (:func:`teardown`) and drop them; a broken group's in a
    thread of their own, which their destructor may block until a pending collective
    times out (the process's exit waits for it). Takes the caller's only references
    (it empties the list)."""
    if not broken:
        for pg in backends:
            teardown(pg, broken=False)
        backends.clear()
        return

    def release() -> None:
        while backends:
            teardown(backends.pop(), broken=True)

    # Not a daemon: the interpreter's exit waits for the release. A daemon thread still
    # inside gloo's destructor when the process exits aborts it ("terminate called
    # without an active exception": its threads are torn down under it).
    threading.Thread(target=release, name="aiosync-release-group").start()
