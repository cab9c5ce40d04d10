"""The trainer ranks' votes of the collective transport, over its own control-only group.

Several trainer ranks agree on every formation and sync with
:meth:`~aiosync.transports._ranks.TrainerRanks.agree` (the outcome encoding IPC
and LoRA use), exchanged over the trainer ranks' gloo group that the
synchronizer forms over its ``TCPStore`` (:func:`._group.create_sync_group`
with ``with_data=False``), so the trainer needs no default process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread

from aiosync.errors import RefitMismatchError, TransportError

from .._ranks import TrainerRanks
from ._group import SyncGroup

__all__ = ["GroupRanks", "SyncVotes", "agree_formation"]


class GroupRanks(TrainerRanks):
    """The trainer ranks as :class:`~aiosync.transports._ranks.TrainerRanks`, over the
    collective's own control-only gloo group (formed over its ``TCPStore``, so the
    trainer needs no default process group): one outcome encoding with IPC and LoRA."""

    def __init__(self, trainers: SyncGroup) -> None:
        super().__init__(None)
        self.group = trainers
        self.rank, self.size = trainers.rank, trainers.world_size
        self.sharded = self.size > 1
        self.is_driver = self.rank == 0

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-encodable), in rank order; blocks a worker thread."""
        return await anyio.to_thread.run_sync(self.group.all_gather_object, obj)


async def _agree(
    ranks: TrainerRanks, weights: Iterator[Any], failure: BaseException | None
) -> None:
    """:meth:`TrainerRanks.agree`; a cancelled rank votes an error and stays cancelled."""
    try:
        await ranks.agree(weights, _as_vote(failure))
    except Exception:
        if failure is not None and not isinstance(failure, Exception):
            raise failure from None
        raise


class SyncVotes:
    """One sync's two trainer votes, each taken exactly once and in this order on
    every rank, whatever failed, so that the ranks' all-gathers pair up: the read
    of the source (before the workers vote), then the sync's outcome.

    Args:
        trainers: the trainer ranks' group (None: one rank, nothing is exchanged).
        weights: this sync's ``policy.iter_weights()``; a rank whose read failed
            drains it in the read vote (the other ranks still gather).
    """

    def __init__(self, trainers: SyncGroup | None, weights: Iterator[Any]) -> None:
        self.ranks = TrainerRanks(None) if trainers is None else GroupRanks(trainers)
        self.weights = weights
        self._read = False

    async def read(self, failure: BaseException | None) -> None:
        """The read vote. Raises the agreed error (this rank's own, or a failed rank's)."""
        self._read = True
        await _agree(self.ranks, self.weights, failure)

    async def outcome(self, failure: BaseException | None) -> None:
        """The outcome vote (the read vote first if this rank never reached it).

        Raises:
            The agreed error; ``failure`` itself when it is a cancellation.
        """
        if not self._read:
            # Only pairs the other ranks' read vote: the outcome vote says the same.
            with contextlib.suppress(BaseException):
                await self.read(failure)
        await _agree(self.ranks, iter(()), failure)


async def agree_formation(trainers: SyncGroup, failure: BaseException | None, digest: str) -> None:
    """The trainer ranks' formation vote: the source's outcome, then the plan digests.

    Raises:
        The agreed error (:meth:`TrainerRanks.agree`); RefitMismatchError on
        every rank when a rank's bucket plan differs from the source's.
    """
    ranks = GroupRanks(trainers)
    await ranks.agree(iter(()), failure)
    with anyio.CancelScope(shield=True):
        digests = await ranks.all_gather(digest)
    odd = [f"trainer rank {r}" for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise RefitMismatchError(
            f"bucket plan digest differs from trainer rank 0 on {', '.join(odd)}: "
            "the trainer ranks' manifests differ"
        )


def _as_vote(failure: BaseException | None) -> Exception | None:
    """What a rank votes for ``failure``: a cancellation is voted as an error."""
    if failure is None or isinstance(failure, Exception):
        return failure
    return TransportError("sync cancelled on a trainer rank")
