"""The trainer's end of the IPC transport's wire: its ROUTER socket and the workers on it.

:class:`_Router` binds the socket in the sender's private directory, waits for the
workers' ``hello`` (each rank's socket identity), receives their replies (a worker's
``error`` raised as the error it names), sends them messages (or, in an inline sync,
keeps them for the receive's session), and tells them to abort. The protocol is in
:mod:`aiosync.transports.ipc.synchronizer`'s docstring; what travels per bucket is
:mod:`._sender`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import zmq
import zmq.asyncio

from aiosync.errors import RefitMismatchError, SyncTimeoutError, TransportError

from .._wire import decode, encode, rebuild_error

#: How long a trainer that cannot reach a worker waits for the error the worker
#: sent before it closed its socket (usually queued already), seconds.
_WORKER_ERROR_GRACE_S = 1.0


def _check_reply(reply: Any, rank: int, method: str) -> None:
    if not isinstance(reply, dict):
        raise TransportError(f"engine worker {rank}: malformed {method} reply {reply!r:.80}")
    if not reply.get("ok"):
        raise rebuild_error(reply, f"engine worker {rank} ({method})")


class _Router:
    """The trainer's ROUTER socket, bound at ``ipc://<directory>/refit.sock``, and what
    it knows of the workers' identities. Every wait is bounded by ``timeout_s``."""

    def __init__(self, directory: str, timeout_s: float, device_id: str) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        #: The device this trainer rank serves (its workers' hello must be for it).
        self.device_id = device_id
        self.endpoint = f"ipc://{self.directory}/refit.sock"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        # A synchronous twin of the socket: a NOBLOCK send on it raises at once
        # (an asyncio socket's returns a future whose error nobody would read).
        self._sync_sock: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self._closed = False
        # The socket identity of the last message received, and the identities of
        # the current sync's workers (``(sync_id, {rank: identity})``, see _handshake).
        self._last_ident = b""
        self._idents: tuple[str, dict[int, bytes]] = ("", {})
        # Each worker's identity as last heard: a worker keeps its socket from one
        # sync to the next, so an abort must reach that identity too.
        self._known_idents: dict[int, bytes] = {}
        #: The messages of the inline sync running (:meth:`_send_all` keeps them), else None.
        self._inline: list[dict[str, Any]] | None = None
        #: Names a worker in an error it sent (a fleet names its engine too).
        self.describe_worker: Callable[[int], str] = lambda rank: f"engine worker {rank}"

    async def _handshake(self, sync_id: str, ranks: Sequence[int], digest: str) -> dict[int, bytes]:
        """Wait for every worker's ``hello`` (of bucket plan ``digest``); returns each
        rank's socket identity.

        A worker names its socket after the sync that opened it (``{sync_id}/{rank}``)
        and keeps it for later syncs of this synchronizer, so the identity is
        the hello's, not this sync's name.
        """
        expected = set(ranks)
        peers: dict[int, bytes] = {}
        self._idents = (sync_id, peers)
        while len(peers) < len(expected):
            rank, msg = await self._recv(sync_id, "the engine workers to connect")
            if msg.get("t") != "hello":
                continue
            if rank not in expected:
                raise TransportError(
                    f"engine worker {rank} connected to the trainer rank of device "
                    f"{self.device_id}, which does not serve it"
                )
            if msg.get("digest") != digest:
                raise RefitMismatchError(
                    f"engine worker {rank} holds bucket plan {str(msg.get('digest'))[:16]}, "
                    f"the trainer sends {digest[:16]}"
                )
            peers[rank] = self._known_idents[rank] = self._last_ident
        return peers

    async def _recv(self, sync_id: str, what: str) -> tuple[int, dict[str, Any]]:
        """The next message of this sync; worker errors are raised, other syncs' dropped."""
        while True:
            try:
                with anyio.fail_after(self.timeout_s):
                    frames = await self._sock.recv_multipart()
            except TimeoutError as exc:
                raise SyncTimeoutError(f"waited {self.timeout_s} s for {what}") from exc
            if len(frames) != 2:
                raise TransportError(f"malformed message of {len(frames)} frames")
            msg = decode(frames[1])
            self._last_ident = frames[0]
            if msg.get("sync_id") != sync_id:
                continue  # a late message of an earlier, failed sync
            rank = msg.get("rank")
            if rank is None:
                ident = frames[0].decode(errors="replace")
                rank = ident.rpartition("/")[2]
            try:
                rank = int(rank)
            except (TypeError, ValueError) as exc:
                raise TransportError(f"message from an unknown peer: {msg!r:.80}") from exc
            if msg.get("t") == "error":
                raise rebuild_error(msg, self.describe_worker(rank))
            return rank, msg

    async def _send_all(
        self, sync_id: str, peers: dict[int, bytes], message: dict[str, Any]
    ) -> None:
        """Send ``message`` to every peer (or, in an inline sync, keep it for the session)."""
        if self._inline is not None:
            self._inline.append(message)
            return
        payload = encode(message)
        for rank, ident in peers.items():
            try:
                await self._sock.send_multipart([ident, payload])
            except zmq.ZMQError as exc:
                raise await self._why_unreachable(sync_id, rank, exc) from exc

    async def _why_unreachable(self, sync_id: str, rank: int, exc: zmq.ZMQError) -> Exception:
        """What to raise when worker ``rank`` of ``sync_id`` cannot be sent to.

        A worker whose receive fails sends its error, then closes its socket; the
        trainer may be sending it the next bucket by then. That error (e.g. a
        :class:`~aiosync.errors.RefitVerificationError`) is the cause: it is still
        queued on the socket, and returned if any worker's of this sync arrives
        within :data:`_WORKER_ERROR_GRACE_S` seconds; else a :class:`TransportError`.
        """
        unreachable = TransportError(f"engine worker {rank} is unreachable: {exc}")
        try:
            with anyio.fail_after(min(_WORKER_ERROR_GRACE_S, self.timeout_s)):
                while True:
                    await self._recv(sync_id, "the error of an unreachable worker")
        except (TimeoutError, SyncTimeoutError):
            return unreachable
        except Exception as error:  # the worker's, re-typed by _recv
            return error

    def abort(self, sync_id: str, ranks: Sequence[int], reason: str) -> None:
        """Tell the workers of ``sync_id`` to stop waiting (best effort, never raises)."""
        if self._closed:
            return
        payload = encode({"t": "abort", "sync_id": sync_id, "reason": reason[:500]})
        # The identities the workers said hello from; a worker not heard from yet
        # would connect as ``{sync_id}/{rank}`` (a new socket) or reuse the one it
        # kept from an earlier sync: both are told, or its receive would wait the
        # whole timeout (holding the worker from the next sync).
        known = self._idents[1] if self._idents[0] == sync_id else {}
        for rank in ranks:
            idents = {known.get(rank, f"{sync_id}/{rank}".encode())}
            if rank in self._known_idents:
                idents.add(self._known_idents[rank])
            for ident in idents:
                with contextlib.suppress(zmq.ZMQError):  # not connected (yet, or any more)
                    self._sync_sock.send_multipart([ident, payload], zmq.NOBLOCK)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()
