"""One call on each of several peers (engines, servers) at once; a failure names its peer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

from . import errors

__all__ = ["each_named", "named"]

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
