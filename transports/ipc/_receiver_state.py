"""What an IPC worker keeps between receives: its plans, whose refit may write, what it holds.

:class:`ReceiverState` is the worker side of the session and of validity: the refit that
may write now and the synchronizer that owns it (another owner's is refused), the
version held whole from an owner's last successful receive (the only base of a delta),
the trainer's buffers it keeps mapped and the connection it keeps open for that owner.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..packing import BucketPlan
from ._shm import MappedBuffer

if TYPE_CHECKING:
    from ._link import TrainerLink

__all__ = ["ReceiverState"]

#: Plans a worker remembers (one per trainer configuration it was initialised with).
_MAX_PLANS = 4


class ReceiverState:
    """One worker's receive state (see the module); created on its first RPC."""

    def __init__(self) -> None:
        self.plans: OrderedDict[str, BucketPlan] = OrderedDict()
        self.lock = threading.Lock()
        #: The refit that may write now, and the synchronizer that owns it (None: idle).
        self.current: str | None = None
        self.owner: str | None = None
        self._claims = threading.Lock()
        #: The reply of the last successful receive, with the devices it came from.
        self.last: dict[str, Any] = {}
        #: Buffer mappings by handle key, kept between receives of ``mapped_owner``.
        self.mapped: dict[str, MappedBuffer] = {}
        self.mapped_owner: str | None = None
        #: The last refit of which this worker loaded a bucket (its weights changed).
        self.touched: str | None = None
        #: ``(owner, version, discard epoch)`` this worker holds whole, from its last
        #: successful receive: the only base a delta patch may be applied to.
        self.held: tuple[str, int, int] | None = None

        #: The DEALER kept connected to ``mapped_owner``'s ROUTER, and its endpoint.
        self.link: TrainerLink | None = None
        self.link_endpoint = ""

    def held_version(self, owner: str, epoch: int) -> int | None:
        """The version held from ``owner``'s last successful receive, if the
        weights were not discarded since (the worker's discard ``epoch``)."""
        if self.held is None or self.held[0] != owner or self.held[2] != epoch:
            return None
        return self.held[1]

    def keep_link(self, link: TrainerLink, endpoint: str) -> None:
        """Keep ``link`` (to ``endpoint``) for the next receive of the same owner."""
        if self.link is not None and self.link is not link:
            self.link.close()
        self.link, self.link_endpoint = link, endpoint

    def reusable_link(self, endpoint: str) -> TrainerLink | None:
        """The kept link if it goes to ``endpoint`` and its monitor reported no
        closed connection since; otherwise close it (if any) and return None."""
        link = self.link
        if link is None:
            return None
        if self.link_endpoint == endpoint and not link.disconnected():
            return link
        self.drop_link()
        return None

    def drop_link(self) -> None:
        """Close the kept link, if any."""
        if self.link is not None:
            self.link.close()
        self.link, self.link_endpoint = None, ""

    def drop_mappings(self, keep: set[str] | frozenset[str] = frozenset()) -> int:
        """Close every kept mapping whose key is not in ``keep``; returns how many."""
        dropped = [key for key in self.mapped if key not in keep]
        for key in dropped:
            self.mapped.pop(key).close()
        return len(dropped)

    def claim(self, owner: str, sync_id: str) -> bool:
        """Make ``sync_id`` the current refit unless another owner's is running."""
        with self._claims:
            if self.owner is not None and self.owner != owner:
                return False
            self.owner, self.current = owner, sync_id
            return True

    def release(self, sync_id: str) -> None:
        """``sync_id`` ended; free the worker unless a newer refit took over."""
        with self._claims:
            if self.current == sync_id:
                self.owner = None

    def remember(self, plan: BucketPlan) -> None:
        self.plans[plan.digest] = plan
        self.plans.move_to_end(plan.digest)
        while len(self.plans) > _MAX_PLANS:
            self.plans.popitem(last=False)
