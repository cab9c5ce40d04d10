"""Which synchronizer's weights each engine object of this process serves.

An engine has one owner at a time: the synchronizer that committed into it last.
A synchronizer asks here at init whether another one holds its engines (it then
syncs before it generates), claims them after each commit (their previous owner
learns that it lost them, and why), and taints their owner after a sync that may
have left them a mix of both. The claims are kept weakly, by engine object. See
:class:`~aiosync.OwnershipError` and ``docs/failures.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .errors import OwnershipError

__all__ = ["Owner", "claim", "held_by_another", "refusal", "taint"]


class Owner(Protocol):
    """A synchronizer as the claims see it: its owner token, and how it learns it lost an engine."""

    #: Its worker-side sessions and its claims are keyed by it (``WeightSynchronizer.owner``).
    owner: str

    def _lose_engines(self, reason: str | None) -> None:
        """Another synchronizer committed into an engine of this one (``reason`` says
        which, and this one's next sync raises it), or may have left it holding a mix
        of both (None): this one is stale."""


#: Each engine object's owner: its token and the synchronizer, weakly.
_OWNERS: weakref.WeakKeyDictionary[Any, tuple[str, weakref.ref[Owner]]] = (
    weakref.WeakKeyDictionary()
)


def held_by_another(engines: Iterable[object], token: str) -> bool:
    """Whether another owner than ``token`` committed last into any of ``engines``: one
    that is gone included (a restarted trainer's), as the engine serves its weights."""
    held = False
    for engine in engines:
        claimed = _OWNERS.get(engine)
        if claimed is not None and claimed[0] != token:
            held = True
    return held


def claim(engines: Iterable[object], owner: Owner, reason: Callable[[object], str]) -> None:
    """After ``owner``'s commit: it owns each of ``engines``; an engine's previous live
    owner loses it, told ``reason(engine)``."""
    for engine in engines:
        previous = _live_owner(engine, owner.owner)
        if previous is not None:
            previous._lose_engines(reason(engine))
        # An engine object that takes no weak reference is not tracked.
        with contextlib.suppress(TypeError):
            _OWNERS[engine] = (owner.owner, weakref.ref(owner))


def taint(engines: Iterable[object], token: str) -> None:
    """The owner of ``engines`` other than ``token`` no longer knows what they hold."""
    for engine in engines:
        owner = _live_owner(engine, token)
        if owner is not None:
            owner._lose_engines(None)


def refusal(holder: str, reason: str, rank: int | None = None) -> OwnershipError:
    """The error of synchronizer ``holder`` (its class's name) that lost its engine
    (``rank``: the trainer rank that learned it, when not this process)."""
    where = "" if rank is None else f"trainer rank {rank}: "
    return OwnershipError(
        f"{where}{holder} no longer owns its engine: {reason}; "
        "await init_communicator() to take it over again"
    )


def _live_owner(engine: object, token: str) -> Owner | None:
    """The live owner of ``engine`` when it is not ``token``."""
    claimed = _OWNERS.get(engine)
    return None if claimed is None or claimed[0] == token else claimed[1]()
