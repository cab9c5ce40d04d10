"""One embedded-engine worker process: connect to the engine, build the worker, then
serve its RPCs by name until told to stop.

Each RPC runs in a thread of a small pool, so a long-running one (a receiver
waiting for the trainer's buckets) does not block the others. The process's main
thread alone touches the socket, in a plain blocking loop (no asyncio): it reads
requests and hands them to the pool, and sends the replies that the pool's
threads queue, woken by a pipe (:class:`_Replies`). The worker object and how it is
built: :mod:`._worker`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq

from aiosync.transports._wire import decode, encode, error_fields

from ._worker import EmbeddedWorker, WorkerSpec, build_worker

__all__ = ["run_worker"]

# The worker module's name, as before this module held the loop: logging is set by it.
_log = logging.getLogger("aiosync.engines.embedded._worker")

#: Threads per worker serving RPCs: a receiver, generations (waiting at the gate
#: while paused), and control calls (pause, resume, status).
_RPC_THREADS = 8
#: How often an idle worker checks that its parent is alive, in milliseconds.
_PARENT_POLL_MS = 1000


def run_worker(endpoint: str, threads: int, spec: WorkerSpec) -> None:
    """Process entry point: connect to ``endpoint``, build the worker ``spec`` describes
    (``threads`` torch threads), serve until told to stop."""
    torch.set_num_threads(threads)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{spec.rank}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    try:
        _serve(sock, spec.rank, functools.partial(build_worker, spec))
    finally:
        sock.close()
        ctx.term()


def _serve(sock: zmq.Socket[bytes], rank: int, build: Callable[[], EmbeddedWorker]) -> None:
    """Build the worker (in a thread of its own), say ``ready``, then serve requests
    until told to ``shutdown`` or the parent is gone; the requests still running
    then are not answered."""
    try:
        with ThreadPoolExecutor(1, thread_name_prefix=f"build{rank}") as builder:
            worker = builder.submit(build).result()
    except Exception as exc:
        _log.exception("embedded worker %d failed to start", rank)
        sock.send(encode({"t": "failed", **error_fields(exc)}))
        return
    sock.send(encode({"t": "ready", "pid": os.getpid()}))
    with ThreadPoolExecutor(_RPC_THREADS, thread_name_prefix=f"rpc{rank}") as pool:
        _Server(sock, rank, worker, pool).serve()


#: Requests the main thread runs itself while no other request runs, instead of
#: handing them to the pool: a thread hop each way costs more than they do
#: (``benchmarks/fixed_cost.py``). Each takes no lock a request holds long, and
#: waits for nothing from outside the process; one that arrives meanwhile waits
#: for it. ``aiosync_ipc_receive`` only with an ``inline`` session (the whole
#: refit in the request: transports/ipc), which loads without waiting on the trainer;
#: ``embedded_wake`` only while nothing sleeps (a synchronizer's wake of an engine
#: that does not report what sleeps: nothing to restore).
_BRIEF = frozenset({"embedded_status", "embedded_set_weight_version", "aiosync_ipc_held_version"})


def _brief(msg: dict[str, Any], worker: EmbeddedWorker) -> bool:
    """Whether ``msg`` is a request of :data:`_BRIEF` (asked while no request runs)."""
    method = msg.get("method")
    if method in _BRIEF:
        return True
    if method == "embedded_wake":
        return not worker._asleep  # no request runs: nothing changes it meanwhile
    if method != "aiosync_ipc_receive":
        return False
    args = msg.get("args")
    if not isinstance(args, list) or not args or not isinstance(args[0], dict):
        return False
    return args[0].get("inline") is not None


class _Server:
    """The main thread's loop: requests from the socket to the pool (or, brief ones
    while the pool is idle, run here), the pool's replies back to the socket."""

    def __init__(
        self, sock: zmq.Socket[bytes], rank: int, worker: EmbeddedWorker, pool: ThreadPoolExecutor
    ) -> None:
        self.sock = sock
        self.rank = rank
        self.worker = worker
        self.pool = pool
        self.replies = _Replies()
        # Requests handed to the pool whose reply was not sent yet (main thread only).
        self.in_pool = 0

    def serve(self) -> None:
        """Until told to ``shutdown``, or the parent is gone."""
        parent = multiprocessing.parent_process()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.replies.fd, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(_PARENT_POLL_MS))
                if not ready:
                    if parent is not None and not parent.is_alive():
                        return
                    continue
                if self.replies.fd in ready:
                    self._send_replies()
                if self.sock in ready and not self._take_requests():
                    return
        finally:
            self.replies.close()

    def _send_replies(self) -> None:
        for payload in self.replies.take():
            self.in_pool -= 1
            self.sock.send(payload)

    def _take_requests(self) -> bool:
        """Serve every request the socket holds now; False once told to shut down."""
        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = decode(raw)
            except Exception:
                _log.exception("worker %d: dropping a malformed request", self.rank)
                continue
            if msg.get("t") == "shutdown":
                self.sock.send(encode({"t": "bye"}))
                return False
            if self.in_pool == 0 and _brief(msg, self.worker):
                self.sock.send(_run(self.worker, msg))
            else:
                self.in_pool += 1
                self.pool.submit(_handle, self.worker, msg, self.replies)


class _Replies:
    """Replies the pool's threads made, for the main thread to send: a queue and a
    pipe whose read end the main thread polls with the socket (one byte a reply)."""

    def __init__(self) -> None:
        self._queue: collections.deque[bytes] = collections.deque()
        self.fd, self._wake = os.pipe()
        os.set_blocking(self.fd, False)

    def put(self, payload: bytes) -> None:
        """Queue ``payload`` and wake the main thread (any thread)."""
        self._queue.append(payload)
        with contextlib.suppress(OSError):  # closed: the worker is leaving
            os.write(self._wake, b"\0")

    def take(self) -> list[bytes]:
        """Every queued reply, oldest first (main thread)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass
        taken = []
        while self._queue:
            taken.append(self._queue.popleft())
        return taken

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._wake)


def _run(worker: EmbeddedWorker, msg: dict[str, Any]) -> bytes:
    """Run one request; its reply, encoded."""
    call_id = msg.get("id")
    try:
        method = msg["method"]
        if not isinstance(method, str) or method.startswith("_"):
            raise AttributeError(f"{method!r} is not an RPC method")
        fn = getattr(worker, method)
        args = msg.get("args") or []
        kwargs = msg.get("kwargs") or {}
        result = fn(*args, **kwargs)
        return encode({"id": call_id, "ok": True, "result": result})
    except Exception as exc:
        return encode({"id": call_id, "ok": False, **error_fields(exc)})


def _handle(worker: EmbeddedWorker, msg: dict[str, Any], replies: _Replies) -> None:
    """Run one request in a pool thread and queue its reply."""
    replies.put(_run(worker, msg))
