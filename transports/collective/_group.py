"""A dedicated torch.distributed group for one non-colocated sync session: forming it.

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

This module forms the group: the session's store (:func:`open_store`), the
rendezvous and the backends (:func:`create_sync_group`). The formed group, its
collectives, votes, abort and teardown, is :class:`SyncGroup`
(:mod:`aiosync.transports.collective._sync_group`, re-exported here).

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
import time
from typing import Any

import torch
import torch.distributed as dist

from aiosync.errors import SyncError, SyncTimeoutError, TransportError

from ._stores import ForwardingStore

# STATUS_*: the formed group's vote codes, importable from here as well (re-exported).
from ._sync_group import STATUS_ERROR as STATUS_ERROR
from ._sync_group import STATUS_MISMATCH as STATUS_MISMATCH
from ._sync_group import STATUS_OK as STATUS_OK
from ._sync_group import STATUS_TIMEOUT as STATUS_TIMEOUT
from ._sync_group import SyncGroup, describe_rank, translate_error

__all__ = ["SyncGroup", "cancel_formation", "create_sync_group", "open_store"]

#: The session's key (under ``aiosync/<session>/``) whose presence cancels its formation.
_CANCEL_KEY = "formation-failed"
#: Longest pause between two looks at the store while a rank waits in a rendezvous, seconds.
_RENDEZVOUS_POLL_S = 0.05


class _RendezvousStore(ForwardingStore):
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
        super().__init__(root)
        self._what = what
        self._timeout_s = timeout_s

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
            if self._inner.check([_CANCEL_KEY]):
                reason = self._inner.get(_CANCEL_KEY).decode(errors="replace")
                raise TransportError(f"{self._what}: cancelled: {reason}")
            if self._inner.check(keys):
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
        raise translate_error(exc, where) from exc


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
        error = exc if isinstance(exc, SyncError) else translate_error(exc, what)
        # Tell the ranks still waiting in the rendezvous (a no-op if one of them
        # cancelled first: its reason is the one kept).
        cancel_formation(store, session, f"{describe_rank(rank, train_world_size)} failed: {error}")
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
