"""A sync into a fleet whose membership changes: quarantine and rolling waves.

The synchronizer's transfer phase when its engine is an
:class:`~aiosync.capabilities.ElasticEngines` fleet: :func:`elastic_transfer` re-forms
the transport after the fleet's membership changed and sets failed engines aside
(``EngineFleet(on_engine_failure="quarantine")``); :func:`rolling_transfer` refits the
fleet wave by wave (``EngineFleet(refit="rolling")``) while the engines outside the
wave serve. The synchronizer owns the rest of the sync (versions, events, commit).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from .capabilities import (
    ElasticEngines,
    EngineSet,
    InFlightPolicy,
    PeerWaves,
    RollingEngines,
    implements,
)
from .errors import UnsupportedOptionError
from .events import VersionEventKind
from .transport import Transferred

if TYPE_CHECKING:
    from .synchronizer import KVScales, WeightSynchronizer, _PauseWindow

__all__ = [
    "check_fleet_options",
    "elastic_fleet",
    "elastic_transfer",
    "rolling_fleet",
    "rolling_transfer",
]

_log = logging.getLogger("aiosync.synchronizer")


def check_fleet_options(sync: WeightSynchronizer) -> None:
    """A fleet that quarantines failed engines or is refit in waves needs a transport
    that re-forms over part of the fleet (``capabilities.elastic``); waves need one
    process driving the fleet too. Never a fleet option silently not honoured.

    Raises:
        UnsupportedOptionError: either is missing (before anything moves).
    """
    fleet = sync.generation
    name = type(sync.transport).__name__
    quarantining = getattr(fleet, "on_engine_failure", None) == "quarantine"
    elastic = sync.transport.capabilities.elastic
    if quarantining and implements(fleet, ElasticEngines) and not elastic:
        raise UnsupportedOptionError(
            f"EngineFleet(on_engine_failure='quarantine'): {name} cannot re-form over "
            "the engines left (its capabilities.elastic is False); use 'fail'"
        )
    if not (implements(fleet, RollingEngines) and fleet.rolling):
        return
    if not elastic:
        raise UnsupportedOptionError(
            f"EngineFleet(refit='rolling'): {name} cannot address part of the fleet "
            "(its capabilities.elastic is False); use refit='all'"
        )
    if sync._sharded():
        raise UnsupportedOptionError(
            f"EngineFleet(refit='rolling'): {name} is driven by a sharded trainer's "
            "ranks, which cannot agree on waves only the driver sees; use refit='all'"
        )


def elastic_fleet(sync: WeightSynchronizer) -> ElasticEngines | None:
    """The engine fleet whose membership may change, when this process alone drives
    it (a sharded trainer's ranks could not agree on a membership only one sees)."""
    if sync._sharded() or not sync._drives_generation():
        return None
    return sync.generation if implements(sync.generation, ElasticEngines) else None


def rolling_fleet(sync: WeightSynchronizer) -> RollingEngines | None:
    """The fleet when it is refit in waves (``EngineFleet(refit="rolling")``)."""
    fleet = elastic_fleet(sync)
    if fleet is not None and implements(fleet, RollingEngines):
        rolling = cast(RollingEngines, fleet)
        return rolling if rolling.rolling else None
    return None


async def elastic_transfer(
    sync: WeightSynchronizer,
    version: int,
    kv_scales: KVScales | None,
    pause: Callable[[], Awaitable[None]] | None,
    discards: int,
) -> tuple[Any, int]:
    """``pause()`` (the engine's ``pause_generation``; None: no pause), then the
    transport's ``send``, after its ``rejoin`` when the fleet's membership changed,
    and, when a failure made the fleet quarantine engines
    (``on_engine_failure="quarantine"``), again over the engines left: each round
    sets at least one engine aside, so this ends.

    A failed pause is such a failure too: an engine that died between syncs fails
    the pause before any byte moves (case C29), and is set aside like one that dies
    during the transfer; the pause is then made again on the engines left (a fleet's
    failed pause cancelled theirs).

    Returns ``send``'s result and the count of discard notices (``sync._discards``)
    the round that moved it started from: ``discards`` unless a round set engines
    aside. The next round moves every tensor to every engine left, so a notice heard
    before it (the dead engine's own above all) is no reason to fail it (case C36).
    """
    fleet = elastic_fleet(sync)
    while True:
        try:
            if pause is not None:
                await pause()
                pause = None  # the engines stay paused through later rounds
            if fleet is not None and fleet.membership_epoch != sync._membership_seen:
                await sync.transport.rejoin(sync)
                await sync._opened()
                sync._membership_seen = fleet.membership_epoch
            return await sync.transport.send(sync, version, kv_scales), discards
        except Exception as exc:
            if fleet is None:
                raise
            removed = await fleet.set_aside_failed(exc)
            if not removed:
                raise
            # What the failed round wrote is no base for a delta.
            if sync.delta is not None:
                sync.delta.settle(committed=False)
            for label, reason in removed:
                _log.warning("quarantined %s: %s", label, reason)
                sync._events.publish(
                    VersionEventKind.ENGINE_QUARANTINED, version, error=reason, engine=label
                )
            discards = sync._discards
            if implements(fleet, EngineSet) and not cast(EngineSet, fleet).engines:
                # A rolling refit's wave whose every engine was set aside: nothing to send.
                return 0, discards


async def rolling_transfer(
    sync: WeightSynchronizer,
    fleet: RollingEngines,
    version: int,
    kv_scales: KVScales | None,
    policy: InFlightPolicy,
    pause: _PauseWindow,
    discards: int,
) -> tuple[Transferred, float]:
    """A rolling refit: for each of the fleet's waves, narrow the fleet to it, pause
    it, transfer (:func:`elastic_transfer`: quarantine applies within the wave),
    check that it landed, label its engines and resume them, while the engines
    outside the wave serve. Returns what moved over all waves and the longest pause
    of a wave, seconds. On a failure the failed wave stays narrowed, with ``pause``
    its window: the caller resumes it, then ends it unfit."""
    nbytes, delta, longest = 0, True, 0.0
    unverified: tuple[str, ...] = ()
    peers = cast(PeerWaves, fleet) if implements(fleet, PeerWaves) else None
    for j, wave in enumerate(fleet.waves()):
        fleet.begin_wave(wave)
        moved: int | Transferred | None = None
        paused = sync._pause_call(policy, pause)
        if j > 0 and peers is not None and peers.peer_waves and not kv_scales:
            # The engines of earlier waves hold this version: copy it from them (the
            # trainer sends nothing for this wave).
            if paused is not None:
                await paused()
                paused = None
            if await peers.copy_wave(version, timeout_s=sync.timeouts.rpc_s) is not None:
                moved = Transferred(0)
        if moved is None:
            moved, discards = await elastic_transfer(sync, version, kv_scales, paused, discards)
        sync._check_landed(version, discards)
        await sync._label_engine(version)
        longest = max(longest, await sync._resume_after(pause.since, failed=False))
        pause.since = None
        fleet.end_wave(committed=True)
        sync._labelling = False
        if isinstance(moved, Transferred):
            nbytes += moved.nbytes
            delta = delta and moved.delta
            unverified = (*unverified, *moved.unverified)
        else:
            nbytes, delta = nbytes + int(moved), False
    return Transferred(nbytes, delta, tuple(dict.fromkeys(unverified))), longest
