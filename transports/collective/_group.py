"""A dedicated torch.distributed group for one non-colocated sync session.

The trainer and the engine each already run their own default process groups
(FSDP, tensor parallelism). The sync group must not touch them, so it is built
from torch's backend classes directly over its own ``TCPStore`` rather than
through ``init_process_group``/``new_group`` (which need, and would join, the
default group):

* ``ctrl`` — a ``ProcessGroupGloo`` of every rank (trainer ranks ``0..T-1``,
  inference ranks ``T..T+W-1``), over CPU tensors: manifest digests and the
  per-sync vote. Gloo on GPU too, so small control messages never queue behind
  bucket broadcasts.
* ``data`` — the bucket broadcasts, on ``nccl`` (CUDA) or ``gloo`` (CPU), over
  the source (trainer rank 0, data rank 0) and the inference ranks (data rank
  ``1 + i``).

The synchronizer forms the engine's session with the source as its only trainer
rank (``train_world_size=1``, as vLLM's weight-transfer API does): the other
trainer ranks take part in the gathers of ``iter_weights()`` and agree on each
outcome with the source in a control-only group of the trainer ranks
(``with_data=False``), never in the engine's.

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

Forming a group is cancellable: a rank whose own part failed (a bad
``GLOO_SOCKET_IFNAME``, a backend that raised, a bad argument) writes the reason
under the session's ``formation-failed`` key (:func:`cancel_formation`), and
every rank still waiting in the rendezvous gives up at once with a
:class:`~aiosync.errors.TransportError` that quotes it, instead of sitting out
the whole timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
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
    "cancel_formation",
    "create_sync_group",
    "open_store",
]

#: Vote codes (one per rank) exchanged after each sync and at formation.
STATUS_OK = 0
STATUS_MISMATCH = 1
STATUS_ERROR = 2
STATUS_TIMEOUT = 3

_DIGEST_BYTES = 32  # SHA-256 of the bucket plan

#: The session's key (under ``aiosync/<session>/``) whose presence cancels its formation.
_CANCEL_KEY = "formation-failed"
#: Longest pause between two looks at the store while a rank waits in a rendezvous, seconds.
_RENDEZVOUS_POLL_S = 0.05
#: The session's key whose presence aborts its groups (:meth:`SyncGroup.abort`).
_ABORT_KEY = "aborted"
#: How long a rank waits on a gloo collective before it looks again whether the group
#: was aborted or trainer rank 0 (its store) is gone, seconds.
_WATCH_S = 0.1


def _describe(rank: int, train_world_size: int) -> str:
    if rank < train_world_size:
        return f"trainer rank {rank}"
    return f"inference rank {rank - train_world_size}"


def _wrap(exc: BaseException, what: str) -> SyncError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeoutError(f"{what}: {text}")
    return TransportError(f"{what}: {text}")


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
        return _describe(rank, self.train_world_size)

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
            raise _wrap(exc, what) from exc

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
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TransportError(
                f"{what}: trainer rank 0 is gone: the sync group's store it serves "
                f"stopped answering ({text})"
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


class _RendezvousStore(dist.Store):
    """The store a gloo group forms over: every wait also watches the cancel key.

    gloo's rendezvous blocks in ``Store.wait`` for each peer's address; over a
    ``TCPStore`` that wait cannot be interrupted, so a rank whose peer had
    already failed sat out the whole timeout. Here a wait looks for its keys and
    for the session's cancel key with ``check`` (one loopback round trip, ~15 us;
    every 1 ms at first, backing off to every 50 ms, and only while a group
    forms) and raises the canceller's reason as soon as it appears.

    Args:
        root: the session's ``PrefixStore`` (``aiosync/<session>``).
        what: prefix of the errors raised (``"forming the sync group (gloo, 3 ranks)"``).
        timeout_s: limit of a wait that names none, seconds.
    """

    def __init__(self, root: dist.Store, what: str, timeout_s: float) -> None:
        super().__init__()
        self._root = root
        self._what = what
        self._timeout_s = timeout_s

    def set(self, key: str, value: str | bytes) -> None:
        self._root.set(key, value)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._root.get(key)

    def add(self, key: str, value: int) -> int:
        return self._root.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._root.check(keys)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self._root.compare_set(key, expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        return self._root.delete_key(key)

    def num_keys(self) -> int:
        return self._root.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` is set.

        Raises:
            TransportError: another rank cancelled the formation (its reason quoted).
            SyncTimeoutError: the keys were not all set within ``timeout``
                (None or zero: the group's timeout).
        """
        limit = timeout.total_seconds() if timeout is not None else 0.0
        limit = limit if limit > 0 else self._timeout_s
        deadline = time.monotonic() + limit
        pause = 0.001
        while True:
            if self._root.check([_CANCEL_KEY]):
                reason = self._root.get(_CANCEL_KEY).decode(errors="replace")
                raise TransportError(f"{self._what}: cancelled: {reason}")
            if self._root.check(keys):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeoutError(
                    f"{self._what}: timed out after {limit:g} s waiting for the other ranks"
                )
            time.sleep(min(pause, left))
            pause = min(2 * pause, _RENDEZVOUS_POLL_S)


def cancel_formation(store: dist.Store, session: str, reason: str) -> None:
    """Make every rank still forming ``session``'s groups over ``store`` give up now.

    Each of them raises :class:`~aiosync.errors.TransportError` quoting
    ``reason`` within ~50 ms. The first reason written is kept (it names the
    root cause; later ones are its echoes). A formation that already completed
    is not affected. Never raises: a store that is gone has no one waiting on it.
    """
    # A store whose server is gone has nobody waiting on it.
    with contextlib.suppress(Exception):
        dist.PrefixStore(f"aiosync/{session}", store).compare_set(_CANCEL_KEY, "", reason)


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


def _make_backend(
    backend: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available():
            raise TransportError("backend 'nccl' needs a CUDA build of torch and a visible GPU")
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, rank, size, opts)
    raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")


def open_store(
    master_addr: str, master_port: int, *, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """The session store: the server on trainer rank 0, a client elsewhere (blocking).

    The trainer keeps its store for the synchronizer's lifetime, so re-forming
    a group never has to bind the port again; each group uses its own key prefix.
    The server binds at once (it does not wait for clients): a port in use
    fails here, in milliseconds. ``master_port=0`` on the server lets the OS
    pick a free port; the store's ``port`` attribute says which.

    Raises:
        TransportError: the port is taken (naming ``master_addr:master_port``).
        SyncTimeoutError: a client found no server within ``timeout_s``.
    """
    where = f"sync-group store at {master_addr}:{master_port}"
    try:
        return dist.TCPStore(
            master_addr,
            master_port,
            None,
            is_master,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as exc:
        text = str(exc)
        if is_master and ("EADDRINUSE" in text or "address already in use" in text.lower()):
            raise TransportError(
                f"{where}: the port is already in use (EADDRINUSE); choose another "
                "TrainCluster.master_port, or 0 to let the OS pick a free one"
            ) from exc
        raise _wrap(exc, where) from exc


def create_sync_group(
    *,
    store: dist.Store,
    rank: int,
    world_size: int,
    train_world_size: int,
    backend: str,
    device: torch.device,
    timeout_s: float,
    session: str,
    with_data: bool = True,
    every_rank_sends: bool = False,
    verdict: tuple[int, str, str] | None = None,
) -> SyncGroup:
    """Build the session's groups over ``store`` (from :func:`open_store`; blocking).

    Keys live under ``aiosync/<session>/`` so a re-formed group never reads a
    previous session's keys. ``with_data=False`` builds the control group only
    (the trainer ranks' own group, which agrees on outcomes and never broadcasts).
    ``every_rank_sends=True`` puts every rank in the data group at its session rank
    (the shard-aware transport's point-to-point traffic: every trainer rank sends).
    ``verdict`` (this rank's status, message and plan digest): the ranks then
    :meth:`SyncGroup.agree` on it before the group is returned; a group whose vote
    failed is destroyed before that error is raised.

    If this rank's part fails, it cancels the formation (:func:`cancel_formation`)
    before raising, so the other ranks give up at once too; it gives up itself as
    soon as another rank (or its driver) cancelled.

    Raises:
        SyncTimeoutError: a rank did not join within ``timeout_s`` seconds.
        TransportError: the backend is unavailable, the rendezvous failed, or
            another rank cancelled the formation (its reason quoted).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    what = f"forming the sync group ({backend}, {world_size} ranks)"
    root = dist.PrefixStore(f"aiosync/{session}", store)
    rendezvous = _RendezvousStore(root, what, timeout_s)
    ctrl = data = None
    try:
        ctrl = dist.ProcessGroupGloo(
            dist.PrefixStore("ctrl", rendezvous), rank, world_size, timeout
        )
        in_data = with_data and (every_rank_sends or rank == 0 or rank >= train_world_size)
        if in_data:
            data_rank = 0 if rank == 0 else 1 + rank - train_world_size
            data_size = 1 + world_size - train_world_size
            if every_rank_sends:
                data_rank, data_size = rank, world_size
            # NCCL meets lazily, at the first collective (bounded by the group's
            # timeout, and a failed peer aborts it): only gloo waits here.
            data_store = rendezvous if backend == "gloo" else root
            data = _make_backend(
                backend, dist.PrefixStore("data", data_store), data_rank, data_size, timeout
            )
    except Exception as exc:
        for pg in (ctrl, data):
            if pg is not None:
                with contextlib.suppress(Exception):  # a half-formed group, peers gone
                    pg.shutdown()
        error = exc if isinstance(exc, SyncError) else _wrap(exc, what)
        # Tell the ranks still waiting in the rendezvous (a no-op if one of them
        # cancelled first: its reason is the one kept).
        cancel_formation(store, session, f"{_describe(rank, train_world_size)} failed: {error}")
        if error is exc:
            raise
        raise error from exc
    group = SyncGroup(
        rank=rank,
        world_size=world_size,
        train_world_size=train_world_size,
        backend=backend,
        device=device,
        timeout_s=timeout_s,
        store=root,
        ctrl=ctrl,
        data=data,
        session=session,
        rendezvous=rendezvous,
    )
    if verdict is not None:
        try:
            group.agree(*verdict)
        except BaseException:
            group.destroy()
            raise
    return group
