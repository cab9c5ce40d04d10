"""vLLM data parallelism: which replicas a backend's ``collective_rpc`` reaches.

See the module docs of :mod:`aiosync.engines.vllm.backend` (one client over every
replica, a client of some replicas only) and ``docs/vllm.md``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiosync.errors import TransportError

from ._drivers import Driver

__all__ = ["WEIGHT_RPCS", "DataParallelScope", "discover_scope"]

#: Worker RPCs of the weight transports that set up or write a refit: refused by
#: a backend that reaches only some of vLLM's data-parallel replicas, unless it
#: is part of an EngineFleet (releases and status calls pass).
WEIGHT_RPCS = frozenset(
    {
        "aiosync_ipc_init",
        "aiosync_ipc_receive",
        "aiosync_collective_init",
        "aiosync_collective_receive",
        "aiosync_collective_stage",
        "aiosync_collective_commit",
        "aiosync_sharded_init",
        "aiosync_sharded_receive",
    }
)


@dataclass(frozen=True)
class DataParallelScope:
    """The vLLM data-parallel replicas a backend's ``collective_rpc`` reaches.

    Attributes:
        size: the engine's ``data_parallel_size`` (1: no data parallelism).
        ranks: the ``data_parallel_index`` of every replica whose workers
            answer, ascending and contiguous.
        replica_world_size: workers per replica (TP × PP).
        fan_out: replies are collected from each engine the client manages
            (vLLM's internal load balancer returns only the first engine's).
    """

    size: int
    ranks: tuple[int, ...]
    replica_world_size: int
    fan_out: bool = False

    @property
    def whole(self) -> bool:
        """True when every replica answers (a sync reaches the whole engine)."""
        return len(self.ranks) == self.size

    @classmethod
    def from_identities(
        cls,
        identities: Sequence[Mapping[str, Any]],
        size: int,
        replica_world_size: int,
        managed: int,
        fan_out: bool = False,
    ) -> DataParallelScope:
        """Check the workers' ``aiosync_worker_identity`` replies against the engine.

        Args:
            identities: one reply per answering worker.
            size: the engine's ``data_parallel_size`` (from the client's config).
            replica_world_size: workers per replica (TP × PP).
            managed: engines the client sends an RPC to (its ``core_engines``).
            fan_out: see the attribute.

        Raises:
            TransportError: a replica answered with fewer or more workers than
                ``replica_world_size`` (or a worker twice), an index outside
                ``0..size-1``, replicas not contiguous, or fewer replicas
                answered than the client reaches (their replies are dropped:
                vLLM's internal load balancer without ``call_utility_all_async``).
        """
        workers = [(int(i["dp_index"]), int(i["replica_rank"])) for i in identities]
        ranks = tuple(sorted({d for d, _ in workers}))
        complete = sorted(workers) == [(d, r) for d in ranks for r in range(replica_world_size)]
        contiguous = bool(ranks) and list(ranks) == list(range(ranks[0], ranks[-1] + 1))
        if not complete or not contiguous or ranks[-1] >= size:
            raise TransportError(
                f"vLLM engine with data_parallel_size={size} and {replica_world_size} "
                f"worker(s) per replica answered collective_rpc from workers "
                f"(dp_index, rank) {sorted(workers)}: not whole replicas; aiosync cannot "
                "tell which workers a sync would reach"
            )
        if len(ranks) < managed:
            raise TransportError(
                f"this vLLM client sends RPCs to {managed} data-parallel engines but "
                f"only replica(s) {list(ranks)} answered (vLLM's internal load balancer "
                "returns the first engine's replies): a sync would reach replicas whose "
                "failures go unseen. Use a vLLM whose AsyncMPClient has "
                "call_utility_all_async, or one AsyncLLM per DP rank "
                "(--data-parallel-external-lb) in an aiosync.EngineFleet"
            )
        return cls(size, ranks, replica_world_size, fan_out)


async def discover_scope(
    driver: Driver,
    identities: Callable[[bool], Awaitable[list[Any]]],
) -> DataParallelScope:
    """Ask the workers who they are when the engine is data parallel.

    Args:
        driver: the engine's driver (its config and engine-core client).
        identities: ``fan_out -> every answering worker's aiosync_worker_identity``.

    Raises:
        TransportError: see :meth:`DataParallelScope.from_identities`.
    """
    # vllm_config fields and the engine-core client differ across vLLM versions
    # and engine kinds: read what is there.
    parallel = getattr(driver.vllm_config, "parallel_config", None)
    size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    per_replica = int(getattr(parallel, "world_size", 1) or 1)
    if size <= 1:
        return DataParallelScope(1, (0,), per_replica)
    core = driver.engine_core()
    managed = len(getattr(core, "core_engines", None) or [None])
    fan_out = driver.can_fan_out(core, managed)
    replies = await identities(fan_out)
    return DataParallelScope.from_identities(replies, size, per_replica, managed, fan_out)
