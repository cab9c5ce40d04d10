"""What the collective's source asks of the engine beside the stream.

Whether a worker died (the engine's health check, whose words name it where gloo's
"Connection reset by peer" names no one), whether every worker holds the delta
baseline, waking the engine's weights before any byte is loaded into them, checking the
workers' answers, and how messages name a worker. A part of
:class:`~aiosync.transports.collective.CollectiveWeightSynchronizer`.
"""

from __future__ import annotations

from typing import Any

import anyio

from aiosync._delta_refit import DeltaRefit
from aiosync.capabilities import HealthReporting, WorkerDescribing
from aiosync.errors import TransportError

from ._loops import SendResult
from ._session import GroupSession

__all__ = ["WorkerQueries"]

#: How long a source whose collective failed waits for the engine to report a dead
#: worker (the cause it names in place of gloo's error), seconds.
_DEATH_NOTICE_S = 1.0


class WorkerQueries(GroupSession):
    """The source's questions to the engine's workers (see the module)."""

    delta: DeltaRefit | None

    async def _death_behind(self, exc: Exception) -> Exception:
        """The dead worker's error in place of ``exc`` (with ``exc`` as a note) if the
        engine reports one within :data:`_DEATH_NOTICE_S`; else ``exc``. A worker's
        death reaches its peers' sockets before its engine sees the process exit."""
        with anyio.move_on_after(_DEATH_NOTICE_S):
            while True:
                dead = await self._dead_worker()
                if dead is not None:
                    dead.add_note(f"meanwhile the engine's workers: {exc!r}")
                    return dead
                await anyio.sleep(0.02)
        return exc

    async def _dead_worker(self) -> Exception | None:
        """The engine's word on a worker that died (its
        :class:`~aiosync.capabilities.HealthReporting` check, bounded by
        ``timeouts.after_failure_s``; a fleet names the engine); None: all alive, or
        the engine cannot tell."""
        if not isinstance(self.generation, HealthReporting):
            return None
        try:
            with anyio.fail_after(self.timeouts.after_failure_s):
                await self.generation.check_health()
        except TimeoutError:
            return None
        except Exception as exc:
            return exc
        return None

    async def _workers_hold_baseline(self) -> bool:
        """Whether every worker holds the baseline's version whole (else: a full sync)."""
        delta = self.delta
        if delta is None or delta.baseline.version != self.weight_version:
            return False
        if not all(delta.holds(engine, self.weight_version) for engine in self._engines()):
            return False  # an engine discarded its weights since the baseline committed
        baseline = delta.baseline
        held = await self._rpc("aiosync_collective_held_version", {}, self.rpc_timeout_s)
        return len(held) == self.inference_world_size and all(h == baseline.version for h in held)

    async def _wake_weights(self) -> None:
        """Wake the engine's weights before any byte is loaded into them.

        An engine asleep at level 1 (vLLM: weights offloaded to CPU, restored on
        wake) would otherwise restore the old weights over the new ones when it
        is woken after the sync. Only an :class:`~aiosync.capabilities.Engine`
        is woken, and only when it may have released its weights
        (:class:`~aiosync.capabilities.SleepReporting`; one that does not say is
        woken). The KV cache is left to ``prepare_for_generation()`` after the sync.
        """
        with anyio.fail_after(self.rpc_timeout_s):
            await self._wake_engines("weights")

    def _check_results(self, sent: SendResult, results: list[Any]) -> None:
        # Not the digests: each worker compared them before its vote (a mismatch
        # failed the sync there, before any worker counted its weights valid).
        if len(results) != self.inference_world_size:
            raise TransportError(
                f"{len(results)} workers answered, inference_world_size is "
                f"{self.inference_world_size}"
            )
        for i, res in enumerate(results):
            if not isinstance(res, dict) or res.get("nbytes") != sent.nbytes:
                raise TransportError(
                    f"inference rank {i} reports {res!r}, expected nbytes={sent.nbytes}"
                )

    def _describe_worker(self, rank: int) -> str:
        """How messages name engine worker ``rank`` (its global rank): the engine's
        own words where it has them (a fleet: ``"engine 1 of 2 (EmbeddedEngine):
        engine worker 3"``), else ``"engine worker <rank>"``."""
        if isinstance(self.generation, WorkerDescribing):
            return self.generation.describe_worker(rank)
        return f"engine worker {rank}"
