"""One call on each of several peers (engines, servers) at once; a failure names its peer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

from . import errors

__all__ = ["each_named", "most_telling", "named"]

_P = TypeVar("_P")
_R = TypeVar("_R")

# aiosync's own errors take one message argument, so they can be re-raised with
# the peer named and their type kept.
_RENAMEABLE = tuple(getattr(errors, name) for name in errors.__all__)


def named(exc: BaseException, label: str) -> BaseException:
    """``exc`` with ``label`` in front: an aiosync error of the same type with
    ``"label: message"`` (caused by ``exc``), any other exception with a note."""
    if type(exc) in _RENAMEABLE:
        renamed = type(exc)(f"{label}: {exc}")
        renamed.__cause__ = exc
        return renamed
    exc.add_note(f"raised by {label}")
    return exc


async def each_named(
    peers: Sequence[_P],
    call: Callable[[int, _P], Awaitable[_R]],
    label: Callable[[int], str],
    *,
    settle: bool = False,
) -> list[_R]:
    """``call(i, peer)`` on every peer concurrently; results in peer order.

    The first peer to fail cancels the others (with ``settle``: the others run
    to their end, as a resume that must reach every peer), and its error is
    raised through :func:`named` with ``label(i)``. One peer: called directly,
    its error as is.
    """
    if len(peers) == 1:
        return [await call(0, peers[0])]
    results: list[Any] = [None] * len(peers)
    failures: list[tuple[int, Exception]] = []

    async def run(i: int, peer: _P, scope: anyio.CancelScope) -> None:
        try:
            results[i] = await call(i, peer)
        except Exception as exc:
            failures.append((i, exc))
            if not settle:
                scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, peer in enumerate(peers):
            tg.start_soon(run, i, peer, tg.cancel_scope)
    if failures:
        index, exc = failures[0]
        raise named(exc, label(index))
    return results


def most_telling(group: BaseException) -> BaseException:
    """The one error to raise for a failed task group (the one reducer every transport uses).

    Walks nested groups; a cancellation counts only if nothing else failed; a
    typed aiosync error wins over the rest, in the order
    ``RefitMismatchError`` (the cause is the data), ``SyncTimeoutError``,
    ``OwnershipError``, ``SyncError`` (``TransportError`` among them), any
    ``Exception``. The others are attached to it as notes (``meanwhile: ...``).
    Not a group: returned as is.
    """
    if not isinstance(group, BaseExceptionGroup):
        return group
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    cancelled = anyio.get_cancelled_exc_class()
    real = [exc for exc in leaves if not isinstance(exc, cancelled)] or leaves
    order = (
        errors.RefitMismatchError,
        errors.SyncTimeoutError,
        errors.OwnershipError,
        errors.SyncError,
        Exception,
        BaseException,
    )
    chosen = next(exc for kind in order for exc in real if isinstance(exc, kind))
    for other in real:
        if other is not chosen:
            chosen.add_note(f"meanwhile: {other!r}")
    return chosen
