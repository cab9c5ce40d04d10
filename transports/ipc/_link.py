"""The IPC worker's connection to the trainer: a monitored ZMQ DEALER, or the inline messages.

:class:`TrainerLink` is a worker's DEALER to the trainer's ``ipc://`` ROUTER, with a
monitor on it: a trainer that dies (even by SIGKILL) closes its end of the connection,
which the monitor reports, so a receive ends with :data:`TRAINER_GONE` at once rather
than at its timeout. :class:`InlineLink` serves a refit whose messages came inside the
session. Both drop nothing of the current refit and everything of another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from aiosync.errors import SyncTimeoutError, TransportError

from .._wire import decode

if TYPE_CHECKING:
    from ._receiver_state import ReceiverState

__all__ = ["TRAINER_GONE", "InlineLink", "TrainerLink"]

# The worker's logger, as before the split: users select it by name.
_log = logging.getLogger(__name__.rpartition(".")[0] + ".worker")

#: How long a closed receiver socket keeps trying to deliver its last message, ms.
_LINGER_MS = 2000

#: Slice of a receive wait after which the worker checks whether it was superseded, ms.
_POLL_SLICE_MS = 100

#: Socket events that may mean the trainer is gone (see :meth:`_TrainerLink._trainer_gone`).
_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED

#: What a worker's receive reports when the trainer's end of the connection vanished.
TRAINER_GONE = "the trainer went away during the refit"


class _Discard:
    """The socket of an :class:`InlineLink`: what the worker sends goes nowhere (the
    trainer reads the outcome from the receive's reply)."""

    def send(self, data: bytes, flags: int = 0) -> None:
        del data, flags


class InlineLink:
    """The messages of a refit the trainer sent inside the session (``inline``), in
    the order the worker would have received them over its connection."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages = list(messages)
        self.sock = _Discard()

    def recv(self, state: ReceiverState, sync_id: str, timeout_s: float) -> dict[str, Any]:
        """The next message.

        Raises:
            TransportError: the session's messages ended before ``end``, or one is
                not a map.
        """
        del state, timeout_s
        if not self.messages:
            raise TransportError(f"refit {sync_id}: the session's messages ended before 'end'")
        msg = self.messages.pop(0)
        if not isinstance(msg, dict):
            raise TransportError(f"malformed inline message {msg!r:.80}")
        return msg


class TrainerLink:
    """A worker's DEALER to the trainer, with a monitor that tells when the trainer is gone."""

    def __init__(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], endpoint: str) -> None:
        self.sock = sock
        self.monitor = monitor
        self.path = endpoint.removeprefix("ipc://")
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    @classmethod
    def connect(cls, endpoint: str, identity: str) -> TrainerLink:
        """A new DEALER named ``identity``, monitored, connecting to ``endpoint``."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        # Linger so a final error or done message still reaches the trainer after close.
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        # Before connect, so no event of this connection is missed: the kernel closes
        # a dead trainer's end of the ipc:// connection, which the monitor reports.
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        link = cls(sock, monitor, endpoint)
        try:
            sock.connect(endpoint)
        except BaseException:
            link.close()
            raise
        return link

    def close(self) -> None:
        """Close the socket (lingering, see ``_LINGER_MS``) and its monitor."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()

    def disconnected(self) -> bool:
        """Drain the monitor; True if it reported the connection closed (or the
        trainer's socket file gone) since it was last drained."""
        gone = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            closed = event == zmq.EVENT_DISCONNECTED
            missing = event == zmq.EVENT_CONNECT_RETRIED and not os.path.exists(self.path)
            gone = gone or closed or missing
        return gone

    def recv(self, state: ReceiverState, sync_id: str, timeout_s: float) -> dict[str, Any]:
        """The next message of refit ``sync_id``.

        Raises:
            TransportError: superseded by a newer refit, or the trainer went away
                (its connection closed, or its socket file is gone).
            SyncTimeoutError: nothing arrived within ``timeout_s`` seconds.

        A message of another refit (one still queued on a kept connection,
        such as the abort of a sync that had already ended here) is dropped.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if state.current != sync_id:
                raise TransportError("superseded by a newer refit")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SyncTimeoutError(f"no message from the trainer within {timeout_s} s")
            # Blocks in zmq_poll; the slice only bounds how late a supersede is seen.
            ready = dict(self.poller.poll(min(_POLL_SLICE_MS, max(1, int(remaining * 1000)))))
            if self.sock in ready:
                msg = decode(self.sock.recv())
                if msg.get("sync_id") != sync_id:
                    _log.debug("dropping a message of refit %r", msg.get("sync_id"))
                    continue
                return msg
            if self.monitor in ready and self._trainer_gone():
                raise TransportError(TRAINER_GONE)

    def _trainer_gone(self) -> bool:
        """Drain the monitor; True if an event says the trainer cannot come back.

        A closed connection is final: the trainer's ROUTER stays bound for the
        whole refit, so only its process dying (or its socket closing) ends it.
        A failed connect is final only when the socket file does not exist (the
        trainer binds before it sends the session); one refused while the file
        exists may be a full listen backlog, so the timeout stays the judge.
        """
        # A message the trainer sent before it died is still delivered first.
        return self.disconnected() and not self.sock.poll(0)
