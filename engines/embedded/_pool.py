"""The embedded engine's worker processes and their RPC: :class:`WorkerPool`.

Workers are processes (:func:`~aiosync.engines.embedded._serve.run_worker`) forked
by multiprocessing's forkserver, which imports torch, transformers and the worker once
(:func:`worker_context`), so a worker or a respawn starts in a fraction of a second
instead of paying those imports again; each is still its own process, with
``spawn``'s semantics (a fresh ``__main__`` import, the parent's environment). They
connect to one ZMQ ROUTER socket, ``ipc://`` in a private (0700) directory
(``aiosync-engine-<pid>-*`` in the temp dir; :meth:`WorkerPool.open` first removes
what dead aiosync processes left, :mod:`aiosync.transports._leftovers`), and
answer msgpack maps. The socket is a plain (blocking) pyzmq socket used only
without blocking, from the event loop: a request is sent at once, and the loop
watches the socket's file descriptor (``add_reader``), reading every reply that
came and handing it to its caller's future (:meth:`WorkerPool._drain`), so no
task reads in the background and concurrent calls share the reading. (pyzmq's
asyncio sockets cost a poll future, a selector registration and a wait per
reply: most of an RPC's time, ``benchmarks/fixed_cost.py``.) A worker that dies
fails its pending calls at once (its process sentinel is watched on the loop).

Requires an asyncio event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import multiprocessing
import multiprocessing.spawn
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, cast

import anyio
import anyio.to_thread
import zmq

from aiosync.errors import SyncError, SyncTimeoutError, TransportError
from aiosync.transports._leftovers import dir_prefix, sweep_leftovers
from aiosync.transports._wire import decode, encode, rebuild_error

__all__ = ["WorkerPool"]

_log = logging.getLogger(__name__)

_WORKER_NAME = "aiosync-embedded-"
# A worker whose bootstrap re-ran a script that starts an engine exits with this code.
_EXIT_UNGUARDED_MAIN = 87
_UNGUARDED_MAIN = (
    "the worker re-ran the main script (multiprocessing imports it again in every "
    "worker) and the script started an engine there: put the code that starts the engine under "
    "'if __name__ == \"__main__\":'"
)
#: How to heal, in every error that reports a dead worker.
RESPAWN_HINT = "EmbeddedEngine.respawn_dead_workers() starts a new one"

#: One ``run_worker`` call per rank: ``(rank, weights_valid) -> args``.
WorkerArgs = Callable[[int, bool], tuple[Any, ...]]


class WorkerPool:
    """``num_workers`` worker processes and the RPC socket they answer on.

    Args:
        num_workers: processes, ranks ``0..num_workers-1``.
        target: the process entry point (``run_worker``).
        worker_args: ``(rank, weights_valid) -> args`` of ``target``.
        rpc_timeout_s: default limit of one :meth:`call`, seconds.
    """

    def __init__(
        self,
        num_workers: int,
        target: Callable[..., None],
        worker_args: WorkerArgs,
        rpc_timeout_s: float,
    ) -> None:
        self.num_workers = num_workers
        self.rpc_timeout_s = rpc_timeout_s
        self._target = target
        self._worker_args = worker_args
        #: The worker processes, rank order.
        self.procs: list[BaseProcess] = []
        self._dead: dict[int, str] = {}
        self._pending: dict[int, tuple[int, asyncio.Future[dict[str, Any]]]] = {}
        self._ids = itertools.count()
        self._ready: list[asyncio.Future[dict[str, Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        # The socket's file descriptor, watched on the loop (None: not yet, or no more).
        self._fd: int | None = None
        self.dir: str | None = None
        self.endpoint = ""
        self.started = False
        self.closed = False

    @property
    def dead(self) -> list[int]:
        """Ranks of the workers that died and were not respawned, ascending."""
        return sorted(self._dead)

    def why_dead(self, rank: int) -> str:
        """How dead worker ``rank`` ended (its exit code)."""
        return self._dead[rank]

    # -- processes ------------------------------------------------------------

    async def start(self, timeout_s: float) -> None:
        """Bind the socket, spawn every worker and wait until each is ready.

        Raises:
            TransportError: a worker failed to build its model or exited.
            SyncTimeoutError: the workers were not ready within ``timeout_s``.
        """
        if multiprocessing.current_process().name.startswith(_WORKER_NAME):
            # A worker's start re-runs the parent's main script before the worker
            # runs; a script without a __main__ guard gets here. Exit with a code the
            # parent turns into the fix, instead of multiprocessing's bootstrap error;
            # at once, as a forkserver's child turns a SystemExit here into code 1.
            sys.stderr.write(f"aiosync: {_UNGUARDED_MAIN}\n")
            sys.stderr.flush()
            os._exit(_EXIT_UNGUARDED_MAIN)
        self.started = True
        self._loop = asyncio.get_running_loop()
        self.dir = await anyio.to_thread.run_sync(_private_dir)
        self.endpoint = f"ipc://{self.dir}/rpc.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        fd = self._sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd
        self._loop.add_reader(fd, self._drain)
        self._ready = [self._loop.create_future() for _ in range(self.num_workers)]
        await self._spawn(range(self.num_workers), weights_valid=True)
        await self._wait_ready(range(self.num_workers), timeout_s)

    async def respawn_dead(self, timeout_s: float) -> list[int]:
        """Start a fresh process (weights marked invalid) for every dead worker;
        returns their ranks.

        Raises:
            TransportError, SyncTimeoutError: a new worker failed to start.
        """
        ranks = self.dead
        if not ranks:
            return ranks
        assert self._loop is not None
        for rank in ranks:
            self._ready[rank] = self._loop.create_future()
            del self._dead[rank]
        await self._spawn(ranks, weights_valid=False)
        await self._wait_ready(ranks, timeout_s)
        return ranks

    async def _spawn(self, ranks: Sequence[int], weights_valid: bool) -> None:
        context = worker_context()
        # A forkserver's children inherit its environment, not ours at start time:
        # each worker takes ours, as a spawned one does by itself.
        environ = dict(os.environ) if isinstance(context, ForkServerContext) else None
        procs = {
            rank: context.Process(
                target=_in_environment,
                args=(environ, self._target, self._worker_args(rank, weights_valid)),
                name=f"{_WORKER_NAME}{rank}",
                daemon=True,
            )
            for rank in ranks
        }

        def start_all() -> None:
            # One after the other in one thread: multiprocessing's bookkeeping
            # of children is not meant for concurrent starts.
            with _main_without_missing_file():
                for proc in procs.values():
                    proc.start()

        # Starting a process blocks (a forkserver round trip or fork-exec, pickling its
        # arguments).
        await anyio.to_thread.run_sync(start_all)
        assert self._loop is not None
        for rank, proc in procs.items():
            if rank < len(self.procs):
                self.procs[rank] = proc
            else:
                self.procs.append(proc)
            self._loop.add_reader(proc.sentinel, self._on_worker_exit, rank)

    async def _wait_ready(self, ranks: Iterable[int], timeout_s: float) -> None:
        ranks = list(ranks)
        try:
            await self._settle([self._ready[rank] for rank in ranks], timeout_s=timeout_s)
        except TimeoutError as exc:
            raise SyncTimeoutError(f"engine workers not ready within {timeout_s} s") from exc
        for rank in ranks:
            msg = self._ready[rank].result()
            if msg.get("t") != "ready":
                raise rebuild_error(msg, f"engine worker {rank} (starting)")

    async def stop(self, ranks: Iterable[int], why: str, timeout_s: float = 10.0) -> None:
        """Kill the live workers among ``ranks`` and count them dead (``why`` in
        their reason), so that :meth:`respawn_dead` replaces them too. The engine
        stops a tensor-parallel replica's survivors this way: its group cannot
        take a new member."""
        for rank in ranks:
            if rank in self._dead:
                continue
            proc = self.procs[rank]
            proc.kill()
            await _join(proc, timeout_s)
            if rank not in self._dead:  # its sentinel's callback may not have run yet
                self._on_worker_exit(rank, why)

    def _on_worker_exit(self, rank: int, why: str | None = None) -> None:
        proc = self.procs[rank]
        assert self._loop is not None
        self._loop.remove_reader(proc.sentinel)
        proc.join(1)  # already exited (its sentinel fired): reaps it
        reason = f"process {proc.pid} exited with code {proc.exitcode}"
        if proc.exitcode == _EXIT_UNGUARDED_MAIN:
            reason += f": {_UNGUARDED_MAIN}"
        if why is not None:
            reason = f"{why} ({reason})"
        self._dead[rank] = reason
        if why is not None:
            _log.info("embedded engine worker %d: %s", rank, reason)
        elif not self.closed:
            _log.warning("embedded engine worker %d: %s", rank, reason)
        error = TransportError(f"engine worker {rank} died: {reason}")
        if rank < len(self._ready) and not self._ready[rank].done():
            self._ready[rank].set_exception(error)
        self._fail_pending(rank, TransportError(f"{error}; {RESPAWN_HINT}"))

    async def close(self, timeout_s: float) -> None:
        """Stop the workers (killing any that do not exit in ``timeout_s``), remove
        the socket directory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._sock is not None:
            for rank, proc in enumerate(self.procs):
                if proc.is_alive() and rank not in self._dead:
                    with contextlib.suppress(zmq.ZMQError):
                        self._sock.send_multipart(
                            [f"w{rank}".encode(), encode({"t": "shutdown"})], zmq.NOBLOCK
                        )
        for proc in self.procs:
            await _join(proc, timeout_s)
            if proc.is_alive():
                proc.kill()
                await _join(proc, timeout_s)
            if self._loop is not None:
                with contextlib.suppress(ValueError, OSError):
                    self._loop.remove_reader(proc.sentinel)
        closed = TransportError("the embedded engine was shut down")
        self._fail_pending(None, closed)
        for ready in self._ready:
            if not ready.done():
                ready.set_exception(closed)
            if not ready.cancelled():
                ready.exception()  # retrieved: a start failure was already reported
        if self._fd is not None and self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._fd)
            self._fd = None
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self.dir is not None:
            await anyio.to_thread.run_sync(
                functools.partial(shutil.rmtree, self.dir, ignore_errors=True)
            )

    # -- RPC ------------------------------------------------------------------

    def check_running(self) -> None:
        """Raises:
        TransportError: the pool was closed.
        SyncError: before :meth:`start`."""
        if self.closed:
            raise TransportError("the embedded engine was shut down")
        if not self.started or self._sock is None:
            raise SyncError("await EmbeddedEngine.start() first")

    async def call(
        self,
        method: str,
        calls: Sequence[tuple[int, list[Any], dict[str, Any]]],
        timeout_s: float | None,
    ) -> list[Any]:
        """``method(*args, **kwargs)`` on each ``(rank, args, kwargs)``; results in that order.

        Raises:
            SyncTimeoutError: not every worker answered within ``timeout_s``
                (None: ``rpc_timeout_s``) seconds.
            TransportError: a worker is dead or died during the call, or raised
                an exception of a type aiosync does not re-raise as itself.
            SyncError (and subclasses), ValueError, TypeError, KeyError,
            AttributeError, NotImplementedError: re-raised from a worker.
        """
        self.check_running()
        assert self._sock is not None and self._loop is not None
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        futures: list[tuple[int, int, asyncio.Future[dict[str, Any]]]] = []
        try:
            for rank, args, kwargs in calls:
                if rank in self._dead:
                    raise TransportError(
                        f"engine worker {rank} is dead: {self._dead[rank]}; {RESPAWN_HINT}"
                    )
                call_id = next(self._ids)
                fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
                self._pending[call_id] = (rank, fut)
                futures.append((rank, call_id, fut))
                msg = {"id": call_id, "method": method, "args": args, "kwargs": kwargs}
                try:
                    await self._send([f"w{rank}".encode(), encode(msg)])
                except zmq.ZMQError as exc:
                    raise TransportError(f"engine worker {rank} unreachable: {exc}") from exc
            try:
                await self._settle(
                    [fut for _, _, fut in futures], fail_fast=True, timeout_s=timeout
                )
            except TimeoutError as exc:
                late = [rank for rank, _, f in futures if not f.done()]
                raise SyncTimeoutError(
                    f"{method} did not return within {timeout} s on engine worker(s) {late}"
                ) from exc
            # A worker that died fails the call now, naming it: the others may be
            # waiting for it (a collective receive), and their replies are dropped.
            for _, _, fut in futures:
                if _failed(fut):
                    raise cast("Exception", fut.exception())
            replies = [fut.result() for _, _, fut in futures]
        finally:
            for _, call_id, _ in futures:
                self._pending.pop(call_id, None)
        results = []
        for (rank, _, _), reply in zip(futures, replies, strict=True):
            if not reply.get("ok"):
                raise rebuild_error(reply, f"engine worker {rank} ({method})")
            results.append(reply.get("result"))
        return results

    async def _send(self, frames: list[bytes]) -> None:
        """Send ``frames`` without blocking the loop, then read what came meanwhile.

        A send may take the socket's readiness signal for replies already queued
        (ZMQ's file descriptor tells of a change, not of a state): reading here
        keeps none of them waiting for a signal that will not come.

        Raises:
            zmq.ZMQError: the worker is unreachable (``ROUTER_MANDATORY``: not
                connected, or gone).
        """
        assert self._sock is not None
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:
                # The worker's queue is full (1,000 requests unread): a rare wait.
                await asyncio.sleep(0.001)
        self._drain()

    async def _settle(
        self,
        futures: Sequence[asyncio.Future[dict[str, Any]]],
        *,
        fail_fast: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Wait until every one of ``futures`` is done (by a reply that
        :meth:`_drain` read, or failed by a worker's death or the pool's close);
        with ``fail_fast``, until one failed. The futures themselves are never
        cancelled (another waiter may share them).

        Raises:
            TimeoutError: not settled within ``timeout_s`` seconds (None or inf: no limit).
        """

        def settled() -> bool:
            if fail_fast and any(_failed(f) for f in futures):
                return True
            return all(f.done() for f in futures)

        if settled():
            return
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()

        def check(_: object = None) -> None:
            if not waiter.done() and settled():
                waiter.set_result(None)

        def expire() -> None:
            if not waiter.done():
                waiter.set_exception(TimeoutError())

        for future in futures:
            future.add_done_callback(check)
        timer = (
            None
            if timeout_s is None or math.isinf(timeout_s)
            else self._loop.call_later(max(0.0, timeout_s), expire)
        )
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            for future in futures:
                future.remove_done_callback(check)

    def _drain(self) -> None:
        """Hand every reply the socket holds now to its future (no wait): the loop's
        reader of the socket, and after every send."""
        sock = self._sock
        if sock is None or sock.closed:
            return
        try:
            while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._route(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        except zmq.ZMQError as exc:  # the context is being terminated
            _log.debug("embedded engine: reading replies: %s", exc)

    def _route(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or not frames[0].startswith(b"w"):
            _log.warning("embedded engine: dropping a reply of %d frames", len(frames))
            return
        try:
            rank = int(frames[0][1:])
            msg = decode(frames[1])
        except (ValueError, TransportError) as exc:
            _log.warning("embedded engine: dropping a malformed reply: %s", exc)
            return
        if msg.get("t") in ("ready", "failed"):
            if 0 <= rank < len(self._ready) and not self._ready[rank].done():
                self._ready[rank].set_result(msg)
            return
        entry = self._pending.get(msg.get("id", -1))
        if entry is not None and entry[0] == rank and not entry[1].done():
            entry[1].set_result(msg)

    def _fail_pending(self, rank: int | None, error: Exception) -> None:
        for worker, fut in list(self._pending.values()):
            if (rank is None or worker == rank) and not fut.done():
                fut.set_exception(error)


def _failed(future: asyncio.Future[Any]) -> bool:
    """Whether ``future`` ended with an exception (a worker's death, the pool's close)."""
    return future.done() and not future.cancelled() and future.exception() is not None


#: What the workers' forkserver imports once: a worker forked from it finds them loaded.
#: A module that is not installed is skipped (the forkserver ignores its ImportError).
PRELOAD = (
    "torch",
    "transformers",
    "aiosync.engines.embedded._serve",
    "aiosync.engines.embedded.model",
)


def worker_context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context that starts engine workers.

    Linux's and macOS's ``forkserver``, its preload set to :data:`PRELOAD` (torch,
    transformers, the worker) so that a worker starts as a fork of a warm
    interpreter: the forkserver pays those imports once per process, on the first
    start. The preload is multiprocessing's one setting for the process; a
    forkserver that is already running keeps its own.

    ``spawn`` where there is no forkserver, and where the process set its own
    executable (``multiprocessing.set_executable``: a wrapper that enters a
    network namespace or sets variables must wrap every worker's start, as it
    does under spawn, not only the forkserver's).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods() or (
        os.fsdecode(multiprocessing.spawn.get_executable()) != sys.executable
    ):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


async def _join(proc: BaseProcess, timeout_s: float) -> None:
    """``proc.join(timeout_s)`` without blocking the event loop, polled on the loop's
    thread: the sentinel's callback (``_on_worker_exit``) reaps there too, and two
    threads reading a forkserver child's sentinel at once leave one of them at EOF,
    which multiprocessing reports as exit code 255."""
    with anyio.move_on_after(timeout_s):
        while proc.exitcode is None:
            await anyio.sleep(0.01)


def _in_environment(
    environ: dict[str, str] | None, target: Callable[..., None], args: tuple[Any, ...]
) -> None:
    """Run ``target(*args)`` with ``environ`` (the parent's when it started the
    worker; None: the one the process has) as the process's environment."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    target(*args)


# Held while __main__.__file__ may be hidden: two engines starting in two threads
# must not restore each other's view of it.
_MAIN_FILE_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_without_missing_file() -> Iterator[None]:
    """Hide ``__main__.__file__`` while processes start if it names no file
    (``python - < script.py`` sets it to ``'<stdin>'``).

    spawn and forkserver re-import the parent's main module in every child from that
    path, and a path that is no file kills the child (``FileNotFoundError: '<cwd>/<stdin>'``)
    before the worker runs. The workers need nothing from ``__main__`` (their entry
    point and arguments are aiosync's), so they start as under ``python -c``, where
    spawn leaves ``__main__`` alone. A main run as a module (``python -m``) or from a
    real file is untouched.
    """
    with _MAIN_FILE_LOCK:
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        spec_name = getattr(getattr(main, "__spec__", None), "name", None)
        hidden_in = None
        if main is not None and spec_name is None and isinstance(path, str):
            # Resolved as spawn resolves it in the child.
            origin = multiprocessing.process.ORIGINAL_DIR  # type: ignore[attr-defined]
            full = path if os.path.isabs(path) or origin is None else os.path.join(origin, path)
            if not os.path.isfile(full):
                hidden_in = main
                del main.__file__
        try:
            yield
        finally:
            if hidden_in is not None:
                hidden_in.__file__ = path


def _private_dir() -> str:
    """Remove what dead aiosync processes (SIGKILLed trainers, engines) left
    behind, then make this engine's 0700 socket directory."""
    sweep_leftovers()
    directory = tempfile.mkdtemp(prefix=dir_prefix("engine"))
    os.chmod(directory, 0o700)
    return directory
