"""Every exception aiosync raises, in one place, and how a lower layer's error becomes one.

The tree, and when each is raised::

    SyncError                      base of everything aiosync raises on purpose; itself:
    │                              a call before ``init_communicator()`` or after
    │                              ``shutdown()``, the engine discarded its weights
    │                              during a sync, a check that could compare nothing
    ├── RefitMismatchError         the two sides disagree on the refit manifest
    │                              (names, shapes, dtypes, bucket layout, the HF
    │                              config, a broken tie); raised before any byte moves
    ├── RefitVerificationError     a worker holds other bytes than the trainer sent:
    │                              a sync's ``verify`` check, or ``verify_engine()``
    ├── TransportError             the peer is gone, answered badly, or broke the
    │                              protocol (dead process, non-2xx HTTP, bad message,
    │                              an httpx, zmq, gloo or Ray error of the layer below)
    │   └── OwnershipError         a worker-side session (sync group, receive)
    │                              belongs to another, live synchronizer, or another
    │                              synchronizer committed into this one's engine
    ├── SyncTimeoutError           a wait ran past its timeout (also a TimeoutError):
    │                              a sync, an RPC, a receive, a collective, a request
    └── UnsupportedOptionError     an option the chosen transport cannot honour, at
                                   construction (also a TypeError)

A lower layer's error becomes one of these in a ``with map_exceptions(...)`` block (as in
httpx's ``map_httpcore_exceptions``), the original as ``__cause__``: the HTTP engines'
httpx errors through one table (``aiosync/engines/_http.py``).

A failed or cancelled ``sync_weights`` leaves ``weight_version`` unchanged and
``is_stale`` true whatever the error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

__all__ = [
    "ExceptionMapping",
    "OwnershipError",
    "RefitMismatchError",
    "RefitVerificationError",
    "SyncError",
    "SyncTimeoutError",
    "TransportError",
    "UnsupportedOptionError",
    "map_exceptions",
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


class UnsupportedOptionError(SyncError, TypeError):
    """An option the chosen transport cannot honour (``create_weight_synchronizer``'s
    ``sync=``/``transport=`` or an old keyword), refused at construction, naming the
    option and the transport: the factory never switches transport to honour it."""


#: What :func:`map_exceptions` takes: each exception type of a layer below, in the order
#: they are tried, and what makes aiosync's error of a caught one.
ExceptionMapping = Mapping[type[BaseException], Callable[[BaseException], BaseException]]


@contextlib.contextmanager
def map_exceptions(mapping: ExceptionMapping) -> Iterator[None]:
    """Raise aiosync's error in place of a lower layer's, as the block's ``except`` clauses would.

    The first type of ``mapping`` (in its order) that the block's exception is an
    instance of makes the error raised instead, from it (its ``__cause__``); an
    exception no type matches propagates unchanged.

    Args:
        mapping: ``{lower_error_type: make}``; ``make(exc)`` returns the error to raise.
    """
    try:
        yield
    except BaseException as exc:
        for kind, make in mapping.items():
            if isinstance(exc, kind):
                raise make(exc) from exc
        raise
