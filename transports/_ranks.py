"""A sharded trainer's ranks as a colocated transport sees them.

Every trainer rank of a sharded (FSDP2) trainer runs the synchronizer, since the
gathers that read the source are collectives; rank 0 alone drives the engine's
RPCs, and the ranks agree on a sync's outcome with one small ``all_gather`` over
the trainer's own process group. Shared by the IPC and the LoRA-adapter
transports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread

from ._wire import error_fields, rebuild_error

__all__ = ["OnTrainerRanks", "TrainerRanks", "drain"]


def drain(weights: Iterator[Any]) -> None:
    """Iterate ``weights`` to its end (a sharded source's remaining gathers); its
    own errors end the draining, they were or will be reported elsewhere."""
    with contextlib.suppress(Exception):
        for _ in weights:
            pass


class TrainerRanks:
    """This process's place among the trainer's ranks (one rank without a group).

    Args:
        group: the trainer's ``torch.distributed`` process group, or None for a
            single-process trainer.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.sharded = self.size > 1
        #: The rank that holds the engine and drives its RPCs.
        self.is_driver = self.rank == 0

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; blocks a worker thread."""
        import torch.distributed as dist

        def gather() -> list[Any]:
            out: list[Any] = [None] * self.size
            dist.all_gather_object(out, obj, group=self.group)
            return out

        return await anyio.to_thread.run_sync(gather)

    async def agree(self, weights: Iterator[Any], failed: BaseException | None) -> None:
        """Commit on every rank or fail on every rank alike: the one rank agreement.

        Each rank contributes its outcome (None, or its error as
        :func:`~aiosync.transports._wire.error_fields`); a rank that failed first
        drains ``weights`` (the other ranks still gather). Shielded: a cancelled
        rank still votes, so that no other rank waits for it.

        Raises:
            This rank's own error if it failed; else the first failed rank's,
            rebuilt with its type and named (``trainer rank r: ...``); else, if
            this rank was cancelled while every rank succeeded, the cancellation.
        """
        if not self.sharded:
            if failed is not None:
                raise failed
            return
        with anyio.CancelScope(shield=True):
            if failed is not None:
                await anyio.to_thread.run_sync(drain, weights)
            outcome = None if failed is None else error_fields(failed)
            outcomes = await self.all_gather(outcome)
        for rank, fields in enumerate(outcomes):
            if fields is not None:
                if rank == self.rank and isinstance(failed, Exception):
                    raise failed
                raise rebuild_error(fields, f"trainer rank {rank}") from failed
        if failed is not None:  # cancelled here, while every rank succeeded
            raise failed


class OnTrainerRanks:
    """What a colocated synchronizer on a sharded trainer's ranks tells the base class:
    rank 0 drives the engine, and the ranks gather over ``self._ranks``. Mixed in
    before :class:`~aiosync.WeightSynchronizer` (IPC, LoRA)."""

    _ranks: TrainerRanks

    def _drives_generation(self) -> bool:
        # Only the rank that holds the engine pauses and resumes it.
        return self._ranks.is_driver

    def _sharded(self) -> bool:
        return self._ranks.sharded

    def _rank(self) -> int:
        return self._ranks.rank

    async def _gather_ranks(self, obj: Any) -> list[Any] | None:
        return await self._ranks.all_gather(obj) if self._ranks.sharded else None
