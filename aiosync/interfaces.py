"""Kept for older imports: the names that ``aiosync.interfaces`` held, from their homes now.

The trainer's side is :mod:`aiosync.sources`, the cluster :mod:`aiosync.cluster`,
the engines' claims :mod:`aiosync.ownership`, the synchronizer
:mod:`aiosync.synchronizer` (the loop's handshake :mod:`aiosync.loop`), the engine's
capabilities :mod:`aiosync.capabilities`.
Import from ``aiosync`` (or those modules); nothing new is added here.
"""

from __future__ import annotations

from ._config import AFTER_FAILURE_TIMEOUT_S, DEFAULT_RESUME_TIMEOUT_S
from .capabilities import IN_FLIGHT_POLICIES, EngineWorkers, InFlightPolicy
from .cluster import TrainCluster
from .loop import refit_if_stale
from .sources import ConfigSource, GathersInto, Preflight, RefitManifest, RefitSource
from .synchronizer import (
    GenerationBackend,
    KVScales,
    Transferred,
    WeightSynchronizer,
)

__all__ = [
    "DEFAULT_RESUME_TIMEOUT_S",
    "IN_FLIGHT_POLICIES",
    "RESUME_AFTER_FAILURE_TIMEOUT_S",
    "ConfigSource",
    "EngineWorkers",
    "GathersInto",
    "GenerationBackend",
    "InFlightPolicy",
    "KVScales",
    "Preflight",
    "RefitManifest",
    "RefitSource",
    "TrainCluster",
    "Transferred",
    "WeightSynchronizer",
    "refit_if_stale",
]

#: Kept for older imports: :data:`aiosync.Timeouts` holds these limits now.
RESUME_AFTER_FAILURE_TIMEOUT_S: float = AFTER_FAILURE_TIMEOUT_S
