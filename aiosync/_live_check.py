"""What ``verify_engine()`` reads back: the workers' digests of their live weights,
compared with the trainer's, and the engines' own checksums (``docs/failures.md``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .capabilities import (
    ChecksumVerifying,
    EngineWorkers,
    LayoutReporting,
    WorkerDescribing,
    engines_of,
)
from .errors import RefitVerificationError
from .sources import RefitSource

if TYPE_CHECKING:
    from .synchronizer import WeightSynchronizer

__all__ = ["engines_checksums", "first_mismatch", "live_digests", "verify_live"]


async def live_digests(
    generation: EngineWorkers, timeout_s: float
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]] | None]:
    """Each worker's ``{name: (shape, dtype, SHA-256)}`` of the weights it computes with
    (``aiosync_weight_digests``, read back through the engine's kernels), in rank order,
    and each rank's layout (``{name: Part}``) when the engine is tensor-parallel (None:
    every worker holds every tensor whole)."""
    layouts = (
        await generation.weight_layouts()
        if isinstance(generation, LayoutReporting) and generation.tensor_parallel_size > 1
        else None
    )
    held = await generation.collective_rpc("aiosync_weight_digests", timeout_s=timeout_s)
    return held, layouts


def first_mismatch(
    policy: RefitSource,
    held: Sequence[Mapping[str, Any]],
    layouts: Sequence[Mapping[str, Any]] | None,
) -> tuple[int, str] | None:
    """``(worker rank, what differs)`` of the first tensor a worker holds otherwise than
    ``policy`` yields it; None: every one matches (blocking: reads the source once)."""
    from ._digest import tensor_digest  # torch: loaded on first use, as the transports

    for name, tensor in policy.iter_weights():
        for rank, digests in enumerate(held):
            part = None if layouts is None else layouts[rank].get(name)
            if layouts is not None and part is None:
                continue  # this rank holds none of it
            if name not in digests:
                return rank, f"holds no {name!r}"
            mine = tensor.detach()
            if part is not None and not part.is_whole:
                mine = mine.narrow(part.dim, part.start, part.length)
            shape, _dtype, digest = digests[name]
            if list(mine.shape) != list(shape):
                return rank, f"{name} is {tuple(shape)}, the trainer's {tuple(mine.shape)}"
            if tensor_digest(mine) != digest:
                return rank, f"{name} differs from the trainer's"
    return None


async def engines_checksums(generation: object) -> int:
    """Ask every :class:`~aiosync.capabilities.ChecksumVerifying` engine behind
    ``generation`` to compare its own checksums with those of the last commit; the
    tensors they matched (0: none recorded).

    Raises:
        RefitVerificationError: an engine's tensor changed since the commit.
    """
    checksummed = 0
    for engine in engines_of(generation):
        if isinstance(engine, ChecksumVerifying):
            checksummed += await engine.verify_recorded_checksums() or 0
    return checksummed


async def verify_live(sync: WeightSynchronizer) -> dict[str, int]:
    """:meth:`~aiosync.WeightSynchronizer.verify_engine`'s check (its docs: returns,
    raises); a digest mismatch or a changed checksum makes ``sync`` stale."""
    sync._check_open()
    if not sync.transport.capabilities.verify_engine:
        # What its workers hold is not what this check reads back (an adapter beside
        # the base weights): comparing would call healthy weights wrong.
        raise NotImplementedError(
            f"{type(sync.transport).__name__} does not declare verify_engine "
            "(its capabilities.verify_engine is False)"
        )
    if sync._sharded():
        raise NotImplementedError("verify_engine() needs a single-process trainer")
    generation = sync.generation
    if not isinstance(generation, EngineWorkers):
        raise TypeError(
            f"verify_engine() reads the weights back through the workers: "
            f"{type(generation).__name__} has no collective_rpc"
        )
    async with sync._lock, sync._source_lock:
        held, layouts = await live_digests(generation, sync.timeouts.rpc_s)
        mismatch = await anyio.to_thread.run_sync(first_mismatch, sync.policy, held, layouts)
    if mismatch is not None:
        rank, what = mismatch
        sync._live_weights_wrong()
        who = (
            generation.describe_worker(rank)
            if isinstance(generation, WorkerDescribing)
            else f"engine worker {rank}"
        )
        raise RefitVerificationError(
            f"{who}: {what} (the trainer's weights of version {sync._policy_version}, "
            f"the engine's labelled {sync._weight_version})"
        )
    try:
        checksummed = await engines_checksums(generation)
    except RefitVerificationError:
        sync._live_weights_wrong()
        raise
    return {
        "workers": len(held),
        "tensors": sum(len(h) for h in held),
        "checksummed": checksummed,
        "version": sync._weight_version,
    }
