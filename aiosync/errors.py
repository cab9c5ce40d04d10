"""Every exception aiosync raises, in one place.

The tree::

    SyncError                      base of everything aiosync raises on purpose
    ├── RefitMismatchError         the two sides disagree on the refit manifest
    │                              (names, shapes, dtypes, bucket layout); raised
    │                              before any byte moves
    ├── TransportError             the peer is gone, answered badly, or broke the
    │                              protocol (dead process, non-2xx HTTP, bad message)
    │   └── OwnershipError         a worker-side session (sync group, receive)
    │                              belongs to another, live synchronizer
    └── SyncTimeoutError           a wait ran past its timeout (also a TimeoutError)

A failed or cancelled ``sync_weights`` leaves ``weight_version`` unchanged and
``is_stale`` true whatever the error.
"""

from __future__ import annotations

__all__ = [
    "OwnershipError",
    "RefitMismatchError",
    "RefitVerificationError",
    "SyncError",
    "SyncTimeoutError",
    "TransportError",
]


class SyncError(Exception):
    """Base class of every error aiosync raises on purpose."""


class RefitMismatchError(SyncError):
    """Trainer and engine disagree on the refit manifest.

    Raised before any data moves, naming the first differing entries on both
    sides (an unknown name, a missing name, a different shape or dtype, or a
    different bucket layout).
    """


class RefitVerificationError(SyncError):
    """What an engine holds is not what the trainer sent (``verify_engine()``): the
    message names the first differing tensor and the worker holding it."""


class TransportError(SyncError):
    """The peer is gone, answered with an error, or violated the protocol."""


class OwnershipError(TransportError):
    """An engine worker refused a call on a session that another synchronizer owns.

    Every worker-side session (a collective sync group, an IPC receive) is keyed
    by its synchronizer's owner token; destroying, joining or driving it from any
    other synchronizer is refused while the owner is alive, so that two trainers
    (or a stale client) on one engine never disturb each other. A session whose
    owner is gone (its store unreachable, its group broken) may be taken over.
    """


class SyncTimeoutError(SyncError, TimeoutError):
    """A wait (a sync, an RPC, a receive, a collective) ran past its timeout."""
