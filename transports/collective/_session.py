"""The collective's group session: forming, joining and dropping its torch.distributed groups.

:class:`GroupSession` is the part of
:class:`~aiosync.transports.collective.CollectiveWeightSynchronizer` that holds the
session: the store (bound once on the source), the engine's group (the source and every
worker) and the trainer ranks' control group, their formation with the workers'
``aiosync_collective_init`` RPC (either side's failure cancels the other's), their
teardown, and the worker thread every blocking collective runs in (abandoned on a
timeout, it destroys the groups it used when it returns). The send and vote path is the
synchronizer's (``docs/reliability.md``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.to_thread
import torch

from aiosync._fanout import most_telling
from aiosync.cluster import TrainCluster
from aiosync.errors import SyncError, SyncTimeoutError, TransportError
from aiosync.synchronizer import WeightSynchronizer

from ..packing import BucketPlan, plan_buckets
from ._group import (
    STATUS_OK,
    SyncGroup,
    cancel_formation,
    create_sync_group,
    open_store,
)
from ._loops import RotatingBuffers
from ._votes import Heartbeat, agree_formation

__all__ = ["GroupSession"]

_T = TypeVar("_T")

# The synchronizer's logger, as before the split: users and tests select it by name.
_log = logging.getLogger(__name__.rpartition(".")[0] + ".synchronizer")


class GroupSession(WeightSynchronizer):
    """The groups of one collective synchronizer and their lifecycle (see the module).

    The synchronizer sets every attribute below in its ``__init__``; a subclass names
    its workers' teardown RPC in :attr:`_destroy_rpc`.
    """

    train_cluster: TrainCluster
    inference_world_size: int
    dist_backend: str
    device: torch.device
    bucket_bytes: int
    collective_timeout_s: float
    _destroy_rpc: ClassVar[str]
    _plan: BucketPlan | None
    _group: SyncGroup | None
    _trainers: SyncGroup | None
    _store: Any
    _bound_port: int | None
    _buffers: RotatingBuffers | None
    _sessions: int
    _session: str
    _syncs: int
    _heartbeat: Heartbeat | None
    _owner: str
    _abandoned: threading.Event
    _idle: threading.Event

    @property
    def rpc_timeout_s(self) -> float:
        """Limit of each control RPC to the workers, seconds (``timeouts.rpc_s``)."""
        return self.timeouts.rpc_s

    @property
    def is_source(self) -> bool:
        """True on trainer rank 0, the rank that sends and drives the workers."""
        return self.train_cluster.rank == 0

    @property
    def master_port(self) -> int | None:
        """The sync group's store port: ``train_cluster.master_port``, or, when that is
        0, the port the OS picked on rank 0 (None until ``init_communicator()`` bound it;
        kept after ``shutdown()``)."""
        return self.train_cluster.master_port or self._bound_port

    @property
    def world_size(self) -> int:
        """Ranks of the engine's sync group: the source plus the inference workers (the
        other trainer ranks never join it)."""
        return 1 + self.inference_world_size

    def _check_backend(self) -> None:
        """Refuse a group that cannot form here: nccl without a visible GPU.

        Raises:
            TransportError: ``dist_backend='nccl'`` without CUDA (says to use gloo).
        """
        if self.dist_backend == "nccl" and not torch.cuda.is_available():
            raise TransportError(
                "dist_backend='nccl' needs a CUDA build of torch and a visible GPU; "
                "use dist_backend='gloo' on CPU"
            )

    async def _form_group(self) -> None:
        self._check_backend()
        await self._teardown(notify_workers=False)
        manifest = await self._read_manifest()
        plan = plan_buckets(manifest, self.bucket_bytes)
        self._sessions += 1
        # Identical on every trainer rank: it names the group's keys in the store.
        session = f"{self._sessions}"
        tc = self.train_cluster
        if self.is_source and self._store is None:
            # Bound before any worker is asked to join: a port in use fails now,
            # not after the workers waited the whole formation limit for a
            # rendezvous that cannot happen.
            self._store = await anyio.to_thread.run_sync(
                lambda: open_store(
                    tc.master_addr,
                    tc.master_port,
                    is_master=True,
                    timeout_s=self.collective_timeout_s,
                )
            )
            self._bound_port = int(self._store.port)
            _log.info(
                "sync-group store listening on %s:%d%s",
                tc.master_addr,
                self._bound_port,
                " (picked by the OS: TrainCluster.master_port=0)" if tc.master_port == 0 else "",
            )

        def store() -> Any:
            if self._store is None:
                self._store = open_store(
                    tc.master_addr,
                    tc.master_port,
                    is_master=self.is_source,
                    timeout_s=self.collective_timeout_s,
                )
            return self._store

        def join_trainers() -> SyncGroup | None:
            return None if tc.world_size == 1 else self._join_trainers(store(), session)

        def join_engine() -> SyncGroup:
            # The engine's session holds the source alone on the trainer side.
            return create_sync_group(
                store=store(),
                rank=0,
                world_size=self.world_size,
                train_world_size=1,
                backend=self.dist_backend,
                device=self.device,
                timeout_s=self.collective_timeout_s,
                session=session,
                verdict=(STATUS_OK, "", plan.digest),
            )

        trainers = await self._in_thread(join_trainers, self._formation_limit())
        group: SyncGroup | None = None
        failure: Exception | None = None
        try:
            if self.is_source:
                # Before any worker is asked to join: a drifted engine config is
                # refused with nothing formed, and the trainer ranks share the verdict.
                await self._check_model_configs()
                group = await self._join_engine(join_engine, plan, session)
        except Exception as exc:
            if trainers is None:
                raise
            failure = exc
        if trainers is not None:
            # Every trainer rank learns the source's verdict and compares plan digests.
            try:
                await agree_formation(trainers, failure, plan.digest)
            except BaseException:
                for g in (group, trainers):
                    if g is not None:
                        await anyio.to_thread.run_sync(g.destroy)
                raise
        self._group, self._trainers, self._plan = group, trainers, plan
        self._session, self._syncs = session, 0
        if trainers is not None and self._heartbeat is None:
            self._heartbeat = Heartbeat(self._store, tc.rank)
        self._buffers = RotatingBuffers(plan, self.device) if self.is_source else None

    def _join_trainers(self, store: Any, session: str) -> SyncGroup:
        """Blocking: form the trainer ranks' control-only gloo group of ``session`` over
        ``store`` (several trainer ranks: it agrees on formations, never broadcasts)."""
        tc = self.train_cluster
        return create_sync_group(
            store=store,
            rank=tc.rank,
            world_size=tc.world_size,
            train_world_size=tc.world_size,
            backend="gloo",
            device=torch.device("cpu"),
            timeout_s=self._trainer_timeout(),
            session=f"{session}/trainers",
            with_data=False,
        )

    async def _join_engine(
        self, join: Callable[[], SyncGroup], plan: BucketPlan, session: str
    ) -> SyncGroup:
        """The source and every engine worker form the engine's session together."""
        # Ask every worker first (leaving any old group is idempotent and
        # cheap): an engine that knows a worker is dead fails this RPC at
        # once, whereas the rendezvous below would wait the whole
        # collective timeout for a rank that never comes, in a thread that
        # cannot be interrupted.
        workers = await self._rpc("aiosync_collective_destroy", {}, self.rpc_timeout_s)
        if len(workers) != self.inference_world_size:
            # Else the rendezvous would wait its whole limit for ranks that never come.
            raise ValueError(
                f"inference_world_size={self.inference_world_size}, but the engine has "
                f"{len(workers)} worker(s): pass inference_world_size={len(workers)}"
            )
        kwargs = {
            "master_addr": self.train_cluster.master_addr,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "train_world_size": 1,
            "backend": self.dist_backend,
            "plan": plan.to_json(),
            "timeout_s": self.collective_timeout_s,
            "session": session,
        }
        if self.delta_baseline is not None:
            kwargs["delta"] = True

        return await self._join_with_workers(join, "aiosync_collective_init", kwargs, session)

    async def _join_with_workers(
        self, join: Callable[[], SyncGroup], method: str, kwargs: dict[str, Any], session: str
    ) -> SyncGroup:
        """Run this rank's ``join`` (in a thread) and the workers' ``method`` RPC together.

        Whichever side fails first cancels the formation for the other at once: a
        worker waiting in the rendezvous for a source whose local set-up failed (or
        our own thread waiting for a worker that failed) gives up within ~50 ms
        instead of sitting out the whole formation limit.
        """

        async def local() -> SyncGroup:
            try:
                return await self._in_thread(join, self._formation_limit())
            except BaseException as exc:
                self._cancel_formation(session, f"trainer rank 0 failed: {_reason(exc)}")
                raise

        async def remote() -> list[Any]:
            try:
                return await self._rpc(method, kwargs, self._formation_limit())
            except BaseException as exc:
                self._cancel_formation(session, f"the engine's workers failed: {_reason(exc)}")
                raise

        group, _ = await self._both(local, remote)
        return group

    def _cancel_formation(self, session: str, reason: str) -> None:
        """Cancel ``session``'s formation on every rank (rank 0, which hosts the store).

        Called on the event loop: one ``compare_set`` on the store this process
        serves, a loopback round trip, so it also runs when the caller was cancelled.
        """
        if self._store is not None:
            cancel_formation(self._store, session, reason)

    async def _teardown(self, *, notify_workers: bool) -> None:
        group, self._group = self._group, None
        trainers, self._trainers = self._trainers, None
        # After a failed sync our group is gone but a worker may still hold its own.
        if notify_workers and self.is_source and self._formed_once():
            # Unreachable workers destroy a broken group themselves.
            with contextlib.suppress(SyncError):
                await self._rpc(self._destroy_rpc, {}, self.rpc_timeout_s)
        # A thread abandoned by a timeout or cancellation may still be in a collective
        # of these groups (each ends within the group's timeout): it destroys them
        # itself when it returns; a short wait spares that in the common case.
        await anyio.to_thread.run_sync(self._idle.wait, self.timeouts.after_failure_s)
        for g in (group, trainers):
            if g is None:
                continue
            if self._idle.is_set():
                await anyio.to_thread.run_sync(g.destroy)
            else:
                g.broken = True
                self._abandoned.set()  # the running thread destroys it when it returns

    def _formed_once(self) -> bool:
        """Whether the workers may hold a group of this synchronizer's."""
        return self._plan is not None

    def _needs_forming(self) -> bool:
        """Whether this rank's groups must be (re-)formed; after a failure every rank
        dropped them, so the trainer ranks re-form together."""
        if self._plan is None:
            return True
        if self.is_source and (self._group is None or self._group.broken):
            return True
        return self.train_cluster.world_size > 1 and (
            self._trainers is None or self._trainers.broken
        )

    def _drop_engine_group(self) -> None:
        group, self._group = self._group, None
        self._drop(group)

    def _drop_trainer_group(self) -> None:
        trainers, self._trainers = self._trainers, None
        self._drop(trainers)

    def _drop(self, group: SyncGroup | None) -> None:
        if group is None:
            return
        group.broken = True
        if self._idle.is_set():
            group.destroy()
        # else: the abandoned thread destroys it when it returns.

    def _formation_limit(self) -> float:
        return 2 * self.collective_timeout_s + self.rpc_timeout_s

    def _trainer_timeout(self) -> float:
        """Limit of the trainer ranks' votes, seconds: the other ranks wait in them while
        the source forms the engine's group or finishes its whole sync."""
        return max(self._formation_limit(), self.sync_timeout_s)

    async def _rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        with anyio.fail_after(timeout_s + 1.0):
            try:
                # Every worker-side call names this synchronizer: the group is its own.
                owned = {**kwargs, "owner": self._owner}
                return await self.generation.collective_rpc(method, (), owned, timeout_s)
            except SyncError:
                raise
            except TimeoutError as exc:
                raise SyncTimeoutError(f"{method} RPC exceeded {timeout_s} s") from exc
            except Exception as exc:
                raise TransportError(f"{method} RPC failed: {exc!r}") from exc

    async def _in_thread(self, fn: Callable[[], _T], limit_s: float) -> _T:
        """Run blocking collectives in a worker thread, bounded by an anyio timeout too.

        torch's own timeout fires first; the anyio one guards against a call
        that ignores it. A thread abandoned that way (or by cancellation) tears
        down the group it used or formed when it finally returns.
        """
        # A thread abandoned by an earlier timeout must finish (its collectives
        # time out) before another one drives a group.
        if not self._idle.is_set():
            await anyio.to_thread.run_sync(self._idle.wait, self.collective_timeout_s)
            if not self._idle.is_set():
                raise TransportError(
                    f"trainer rank {self.train_cluster.rank}: a thread of an earlier, "
                    "abandoned sync step is still inside a collective after "
                    f"collective_timeout_s={self.collective_timeout_s:g} s; shut this "
                    "synchronizer down and create another"
                )
        self._idle.clear()
        self._abandoned.clear()
        groups = (self._group, self._trainers)
        # "queued" until a worker thread starts ``run``; a call cancelled while queued
        # never runs (anyio skips a cancelled job), so nothing else would set _idle.
        state = ["queued"]
        lock = threading.Lock()

        def run() -> _T:
            with lock:
                if state[0] == "dropped":
                    raise TransportError("sync step cancelled before it started")
                state[0] = "running"
            result: Any = None
            try:
                result = fn()
                return result
            finally:
                if self._abandoned.is_set():
                    for g in (*groups, result):
                        if isinstance(g, SyncGroup):
                            g.broken = True
                            g.destroy()
                self._idle.set()

        try:
            with anyio.fail_after(limit_s):
                return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except BaseException:
            with lock:
                if state[0] == "queued":
                    state[0] = "dropped"  # it never touched a group: nothing to abandon
                    self._idle.set()
            if not self._idle.is_set():
                self._abandoned.set()
            raise

    async def _both(
        self,
        local: Callable[[], Awaitable[_T]],
        remote: Callable[[], Awaitable[list[Any]]],
        *,
        group: SyncGroup | None = None,
    ) -> tuple[_T, list[Any]]:
        """Run this rank's side and the workers' RPC together; neither cancels the other
        (each is bounded by its own timeout), so every rank reaches its vote.

        With ``group`` (a sync), the first side to fail aborts it
        (:meth:`SyncGroup.abort`): when the workers' RPC failed (an engine worker
        died: the engine says which), this rank and the surviving workers stop
        waiting in its collectives at once instead of at the group's timeout.

        Raises:
            The more telling of the two errors (:func:`~aiosync._fanout.most_telling`;
            this rank's side first among equals), the other attached as a note.
        """
        results: dict[str, Any] = {}
        errors: dict[str, Exception] = {}

        async def run(key: str, fn: Callable[[], Awaitable[Any]]) -> None:
            try:
                results[key] = await fn()
            except Exception as exc:
                errors[key] = exc
                if group is not None:
                    who = "trainer rank 0" if key == "local" else "the engine's workers"
                    group.abort(f"{who} failed: {type(exc).__name__}: {exc}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "local", local)
            tg.start_soon(run, "remote", remote)
        if errors:
            both = [errors[key] for key in ("local", "remote") if key in errors]
            raise most_telling(ExceptionGroup("the source and the workers failed", both))
        return results["local"], results["remote"]


def _reason(failure: BaseException) -> str:
    """``failure`` as the reason a formation was cancelled (a cancellation says so)."""
    if not isinstance(failure, Exception):
        return "init_communicator() was cancelled"
    return f"{type(failure).__name__}: {failure}"
