"""A sharded trainer's ranks as a colocated transport sees them.

Every trainer rank of a sharded (FSDP2) trainer runs the synchronizer, since the
gathers that read the source are collectives; rank 0 alone drives the engine's
RPCs, and the ranks agree on a sync's outcome with one small ``all_gather`` over
the trainer's own process group. Shared by the IPC and the LoRA-adapter
transports, which give it to the synchronizer as its ``ranks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread

from ._wire import error_fields, rebuild_error

__all__ = ["TrainerRanks", "drain"]


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
        #: As :class:`~aiosync.cluster.Ranks` names it: only the driver pauses,
        #: wakes and labels the engine.
        self.drives_generation = self.is_driver

    @classmethod
    def driving(cls, group: Any, generation: Any) -> TrainerRanks:
        """The ranks of ``group``; ``generation`` is needed on the rank that drives it.

        Raises:
            ValueError: ``generation`` is None on the driving rank (rank 0).
        """
        ranks = cls(group)
        if ranks.is_driver and generation is None:
            raise ValueError("generation is None on the trainer rank that drives the engine")
        return ranks

    async def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order (:class:`~aiosync.cluster.Ranks`); None
        for a single-process trainer."""
        return await self.all_gather(obj) if self.sharded else None

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
