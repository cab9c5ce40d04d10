"""The kit's ``sharded_trainer`` cell: a trainer of several ranks, each running the
synchronizer, ends every sync with the same versions on every rank, or the same error.

The ranks are synchronizers of one process, each reading its own copy of the model
(the ranks of a data-parallel trainer; a sharded source's ranks would each gather
their part), agreeing through the ``TrainCluster``'s store. A transport whose ranks
agree over the trainer's own ``torch.distributed`` group (one process a rank) runs the
same contract in the suite its case names (``TransportCase.rank_processes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from aiosync import RefitMismatchError

from .cases import TransportCase
from .engines import KitEngine
from .fault_checks import _assert_refuses_or_serves
from .sync_checks import _assert_serves
from .trainers import KitTrainer

#: The trainer's ranks (rank 0 drives the engine).
RANKS = 2


async def on_every_rank(syncs: Sequence[Any], method: str) -> list[BaseException | None]:
    """``method()`` on every rank at once (as each rank's process would call it): each
    rank's exception, or None."""
    out: list[BaseException | None] = [None] * len(syncs)

    async def one(rank: int) -> None:
        try:
            await getattr(syncs[rank], method)()
        except Exception as error:
            out[rank] = error

    async with anyio.create_task_group() as tg:
        for rank in range(len(syncs)):
            tg.start_soon(one, rank)
    return out


def _versions(syncs: Sequence[Any]) -> list[tuple[int, int, bool]]:
    return [(s.weight_version, s.policy_version, s.is_stale) for s in syncs]


async def check_sharded_trainer(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer
) -> None:
    """Two trainer ranks (the same model, each rank its own source; rank 0's engine):
    every sync leaves every rank at the same next version and not stale, the engine
    holding exactly the trainer's tensors and serving them. A source that drifts from
    its manifest on rank 1 (its 6th tensor cut short) fails the sync on every rank
    alike (``RefitMismatchError``; rank 0's names rank 1), the version unchanged and
    every rank stale, the engine refusing to generate or serving the previous version
    exactly; the next sync heals it on every rank."""
    sources = [trainer, *(case.trainer(trainer.seed) for _ in range(RANKS - 1))]
    syncs = case.build_ranks(sources, engine)
    try:
        assert await on_every_rank(syncs, "init_communicator") == [None] * RANKS
        for version in (1, 2):
            if version == 2:
                for source in sources:
                    source.step(seed=21)
            assert await on_every_rank(syncs, "mark_stale") == [None] * RANKS
            assert await on_every_rank(syncs, "sync_weights") == [None] * RANKS
            assert _versions(syncs) == [(version, version, False)] * RANKS
            assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)

        v2 = trainer.state()
        for source in sources:
            source.step(seed=22)
        sources[-1].drift_at = 5
        assert await on_every_rank(syncs, "mark_stale") == [None] * RANKS
        errors = await on_every_rank(syncs, "sync_weights")
        assert [type(e) for e in errors] == [RefitMismatchError] * RANKS, errors
        assert str(errors[0]) == f"trainer rank {RANKS - 1}: {errors[-1]}"
        assert _versions(syncs) == [(2, 3, True)] * RANKS
        await _assert_refuses_or_serves(engine, v2, 2)

        assert await on_every_rank(syncs, "sync_weights") == [None] * RANKS
        assert _versions(syncs) == [(3, 3, False)] * RANKS
        assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 3)
    finally:
        await on_every_rank(syncs, "shutdown")
