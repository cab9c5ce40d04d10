"""A worker's rank among every engine worker one synchronizer feeds (engine-side, shared).

One synchronizer may feed several engines at once (an :class:`~aiosync.EngineFleet`,
or vLLM's data-parallel replicas). Each worker then needs a rank that is unique
across all of them, for the IPC transport's socket identities and the collective
transport's group ranks. As vLLM's own NCCL weight-transfer engine does, the rank
is ``data_parallel_index * world_size + rank`` (``world_size`` = TP × PP of one
replica), plus an offset the fleet gives each engine (the worker counts of the
engines before it).
"""

from __future__ import annotations

__all__ = ["WorkerRankMixin"]


class WorkerRankMixin:
    """Gives a worker its rank among every worker of the synchronizer's engines.

    Reads ``self.rank`` (vLLM's ``Worker.rank``, the embedded engine's; 0 when
    absent) and, on vLLM, ``self.parallel_config`` (``rank``, ``world_size``,
    ``data_parallel_index``).
    """

    _aiosync_rank_offset: int = 0

    def aiosync_set_rank_offset(self, offset: int) -> int:
        """Called by :class:`~aiosync.EngineFleet`: this engine's workers start at
        rank ``offset`` (>= 0). Returns the worker's rank with the offset applied.

        Raises:
            ValueError: ``offset`` is negative or not an int.
        """
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"rank offset must be an int >= 0, got {offset!r}")
        self._aiosync_rank_offset = offset
        return self.aiosync_worker_rank()

    def aiosync_worker_rank(self) -> int:
        """``offset + data_parallel_index * world_size + rank`` (0-based)."""
        config = getattr(self, "parallel_config", None)
        index = getattr(config, "data_parallel_index", None)
        if index is None:
            index = getattr(config, "data_parallel_rank", None) or 0  # older vLLM
        rank = getattr(config, "rank", None)
        if rank is None:
            rank = getattr(self, "rank", None) or 0
        per_replica = int(getattr(config, "world_size", 1)) if index else 1
        return self._aiosync_rank_offset + int(index) * per_replica + int(rank)
