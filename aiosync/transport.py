"""The part of a synchronizer that moves bytes: a :class:`Transport`, with named phases.

:class:`~aiosync.WeightSynchronizer` owns everything transports share: versions,
events, ownership, pause/resume and the in-flight policy, the colocated bracket, the
delta baseline's outcome, verification bookkeeping, fleet membership and quarantine,
rank agreement, timeouts. A transport is passed in (``WeightSynchronizer(policy,
generation, transport=...)``), as httpx's client takes an ``AsyncBaseTransport``, and
implements four phases, named after vLLM's ``WeightTransferEngine``; the synchronizer
calls them, the training loop never does. ``docs/transports.md`` shows a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .options import TransportCapabilities

if TYPE_CHECKING:
    from .synchronizer import KVScales, WeightSynchronizer

__all__ = ["Transferred", "Transport"]


@dataclass(frozen=True, slots=True)
class Transferred:
    """What one sync's transfer moved (a transport's ``send`` result).

    Attributes:
        nbytes: payload bytes moved to the workers.
        delta: they were delta patches (:mod:`aiosync.delta`), not every tensor.
        unverified: ``"name: why"`` of each tensor the sync's ``verify=True`` check
            could not compare (published in the ``COMMITTED`` event).
    """

    nbytes: int
    delta: bool = False
    unverified: tuple[str, ...] = ()


@runtime_checkable
class Transport(Protocol):
    """A transport's phases, each given the synchronizer that holds it (``sync``: its
    ``policy``, ``generation``, ``ranks``, ``timeouts``, ``delta`` and versions).

    Attributes:
        capabilities: what it can do, as data (:class:`~aiosync.TransportCapabilities`):
            the factory refuses an option outside it, the conformance kit runs its cells.
    """

    capabilities: TransportCapabilities

    async def open(self, sync: WeightSynchronizer) -> None:
        """Set up once the engine's workers exist: read and compare manifests (before
        any byte moves), open sockets, form groups. Called by ``init_communicator()``,
        again after a respawn; must leave nothing half-open when it raises."""
        ...

    async def send(
        self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None
    ) -> int | Transferred:
        """Move the weights of ``version`` (and ``kv_scales``, checked already) to every
        worker, the workers' own commit included; return the bytes moved, or a
        :class:`Transferred` (also: a delta, what went unverified).
        Raise on any failure: the synchronizer keeps the versions consistent."""
        ...

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        """The fleet's engines changed (a quarantine, an ``add_engine``): set up again
        over the engines now in the sync (most transports: :meth:`open` again)."""
        ...

    async def close(self, sync: WeightSynchronizer) -> None:
        """Release everything (sockets, groups, buffers); idempotent, and works after a
        failure. ``shutdown()`` calls it before the synchronizer's own release."""
        ...
