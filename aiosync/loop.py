"""The training loop's handshake: :func:`refit_if_stale` (see ``docs/loop.md``)."""

from __future__ import annotations

import logging

import anyio

from .capabilities import Engine, RestartReporting, engines_of
from .synchronizer import WeightSynchronizer

__all__ = ["refit_if_stale"]

_log = logging.getLogger("aiosync.synchronizer")


async def _check_restarts(generation: object) -> None:
    """Ask every :class:`~aiosync.capabilities.RestartReporting` engine behind
    ``generation`` whether it was restarted (a restart runs the discard listeners, so
    ``is_stale`` reads True after this). An engine that does not answer is left to the
    sync or the generation that needs it (logged here): the probe only learns."""
    engines = [e for e in engines_of(generation) if isinstance(e, RestartReporting)]

    async def ask(engine: RestartReporting) -> None:
        try:
            await engine.check_restarted()
        except Exception as exc:
            _log.warning("refit_if_stale: could not ask %r whether it restarted: %s", engine, exc)

    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(ask, engine)


async def refit_if_stale(sync: WeightSynchronizer, generation: Engine | None = None) -> bool:
    """The loop's handshake before generating.

    First asks each engine that can tell (:class:`~aiosync.capabilities.RestartReporting`:
    an SGLang server reached by URL) whether it was restarted since it was synced (a
    restarted server holds fresh weights: the synchronizer turns stale). Then, if
    ``sync.is_stale``: ``await sync.sync_weights()`` then
    ``await generation.prepare_for_generation()``. Returns whether it refit.
    Errors of ``sync_weights`` propagate and ``prepare_for_generation`` is
    then not called, so the engine never generates with half-updated weights.

    On a sharded trainer's ranks that do not hold the engine (``generation`` and
    ``sync.generation`` both None) it syncs if stale and wakes nothing: the same
    call is right on every rank.

    Args:
        generation: the engine to wake; default ``sync.generation`` (the engine,
            or the :class:`~aiosync.EngineFleet` a list of engines became).

    Raises:
        TypeError: ``generation`` has no ``prepare_for_generation`` (e.g. a plain
            list of engines), before anything is synced.
    """
    if generation is None:
        generation = sync.generation
    if generation is None and not sync._drives_generation():
        if not sync.is_stale:
            return False
        await sync.sync_weights()
        return True
    if not isinstance(generation, Engine):
        raise TypeError(
            f"generation must be an engine with prepare_for_generation, got "
            f"{type(generation).__name__}; for a fleet pass sync.generation (or omit it)"
        )
    await _check_restarts(generation)
    if not sync.is_stale:
        return False
    await sync.sync_weights()
    await generation.prepare_for_generation()
    return True
